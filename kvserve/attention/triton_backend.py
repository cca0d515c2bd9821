"""The Triton backend: paged attention that reads every KV format in place
(:mod:`kvserve.kernels.triton_attention`), the reference
(:class:`~kvserve.attention.torch_backend.TorchBackend`) wherever it declines.

What it serves, call by call:

- decode rows of every format (dense, fp8, int8, KIVI with its residual and rotation),
  straight from the blocks through the block table, per-sequence windows included;
- the paged group (decode rows and short chunks over a cached context) of the dense formats,
  whose cached entries are exactly the chunk's fresh K/V, with retention's extras there:
  StreamingLLM's sinks (scored with the queries rotated back) and H2O's attention mass (a
  second pass over the keys adds each entry's probability); a lossy format's chunk attends its
  own fresh K/V on the reference path, as the reference defines it;
- the KV write of every format (:mod:`kvserve.kernels.triton_kv_write`) driven by the slot
  mapping: one kernel per layer for dense, fp8 and int8; for KIVI one that quantizes the
  step's whole blocks and one that fills the residual, following the storage's step plan.

Prefill chunks that start a sequence, long chunks and the lossy formats' retention rows take
the reference paths. It runs on CUDA, and on a CPU only under
Triton's interpreter (``TRITON_INTERPRET=1``, for tests: it is slow). ``auto`` does not pick it
yet: it picks it once the kernels have passed their tests on a GPU.

The table of formats is keyed by the storage's exact class, as the CPU backend's is: a wrapper
or subclass may change what a read sees, and only ``gather`` honours that.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from kvserve.attention.torch_backend import TorchBackend
from kvserve.kv.codecs import KEY_SCALE_STEPS
from kvserve.kv.kivi_storage import KiviKVStorage
from kvserve.kv.quant_storage import Fp8KVStorage, Int8KVStorage
from kvserve.kv.storage import DenseKVStorage, KVStorage

if TYPE_CHECKING:
    from kvserve.attention.metadata import PagedGroup
    from kvserve.kernels.triton_attention import PagedCache


# Whether Triton can be imported: without it (a CPU install without the test extra) a backend
# named ``triton`` on CUDA declines every call, and the reference runs.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton is installed and set to run kernels in its interpreter."""
    if not HAVE_TRITON:
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def paged_cache(st: KVStorage, layer: int) -> PagedCache | None:
    """The kernel's view of one layer of ``st``; None for a storage class or geometry the
    kernel does not read (head sizes that are not a power of two from 16 to 256), or when
    Triton is not installed."""
    d = st.head_dim
    if not HAVE_TRITON:
        return None
    from kvserve.kernels import triton_attention as ta

    if d < 16 or d > 256 or d & (d - 1):
        return None
    kind = type(st)
    if kind is DenseKVStorage:
        return ta.PagedCache(ta.DENSE, st.k[layer], st.v[layer])
    if kind is Fp8KVStorage:
        e5m2 = st.fp8_dtype == torch.float8_e5m2
        return ta.PagedCache(ta.FP8, st.k_codes[layer], st.v_codes[layer], ks=st.k_scale[layer],
                             vs=st.v_scale[layer], e5m2=e5m2)  # fmt: skip
    if kind is Int8KVStorage:
        return ta.PagedCache(ta.INT8, st.k_codes[layer], st.v_codes[layer],
                             ks=st.k_scale[layer], vs=st.v_scale[layer])  # fmt: skip
    if kind is KiviKVStorage:
        return ta.PagedCache(
            ta.KIVI, st.k_codes[layer], st.v_codes[layer], ks=st.k_meta[layer],
            vs=st.v_scale[layer], kz=st.k_base[layer], vz=st.v_zero[layer],
            res_map=st.res_of_block_t, rk=st.res_k[layer], rv=st.res_v[layer],
            rotation=st.key_rotation, bits=st.bits, vgroup=st.group,
        )  # fmt: skip
    return None


class TritonBackend(TorchBackend):
    name = "triton"
    device_types = frozenset({"cuda", "cpu"})
    # Below the reference until the kernels have passed their tests on a GPU: named only.
    auto_priority = -1

    def __init__(self) -> None:
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._rows: dict[torch.device, torch.Tensor] = {}
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._key_scales: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        """On CUDA; on a CPU only under the interpreter."""
        if device.type == "cpu":
            return interpreting()
        return device.type == "cuda"

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return cls.runs_on(device) and HAVE_TRITON

    # -- buffers kept across calls (nothing is allocated per call once they have grown) --------
    def workspace(self, q: torch.Tensor, num_splits: int) -> torch.Tensor | None:
        from kvserve.kernels.triton_attention import workspace_numel

        if num_splits <= 1:
            return None
        need = workspace_numel(q, num_splits)
        buf = self._workspace.get(q.device)
        if buf is None or buf.numel() < need:
            buf = self._workspace[q.device] = torch.empty(need, device=q.device)
        return buf

    def arange(self, n: int, device: torch.device) -> torch.Tensor:
        buf = self._rows.get(device)
        if buf is None or buf.numel() < n:
            buf = self._rows[device] = torch.arange(max(n, 256), device=device)
        return buf[:n]

    def ones(self, n: int, device: torch.device) -> torch.Tensor:
        buf = self._ones.get(device)
        if buf is None or buf.numel() < n:
            buf = self._ones[device] = torch.ones(max(n, 256), dtype=torch.long, device=device)
        return buf[:n]

    def _attend(
        self, q: torch.Tensor, cache: PagedCache, out: torch.Tensor, q_start: torch.Tensor,
        q_len: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor,
        windows: torch.Tensor | None, window: int | None, num_rows: int, block_q: int,
        sinks: torch.Tensor | None = None, q_back: torch.Tensor | None = None,
        votes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        from kvserve.kernels import triton_attention as ta

        heads, kvh = q.shape[1], cache.k.shape[1]
        bq = max(1, min(block_q, ta.block_m(heads // kvh) // (heads // kvh)))
        splits = ta.choose_splits((num_rows // bq + tables.shape[0]) * kvh,
                                  tables.shape[1] * cache.block_size, q.device)  # fmt: skip
        if votes is not None:
            splits = 1
        ta.paged_attention(q, cache, out, q_start, q_len, ctx, tables, windows, window,
                           num_rows, bq, splits, self.workspace(q, splits), sinks, q_back,
                           votes)  # fmt: skip

    # -- the hooks -------------------------------------------------------------------------
    def write_kv(self, layer, storage, slot_mapping, k, v) -> bool:  # noqa: ANN001
        """Dense, fp8 (once the layer's scales are calibrated: calibration reads the first
        prefill's amax on the host), int8, and KIVI at block sizes of 16 and up (its step
        plan, made on the host by ``begin_step``, says which blocks are quantized whole and
        which tokens wait in the residual)."""
        kind = type(storage)
        if kind is KiviKVStorage:
            return self._write_kivi(layer, storage, k, v)
        if kind not in (DenseKVStorage, Fp8KVStorage, Int8KVStorage):
            return False
        if kind is Fp8KVStorage and not storage.calibrated[layer]:
            return False
        cache = paged_cache(storage, layer)
        if cache is None:
            return False
        from kvserve.kernels.triton_kv_write import kv_write

        kv_write(cache, slot_mapping, k, v)
        return True

    def _write_kivi(
        self, layer: int, storage: KiviKVStorage, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        bs = storage.block_size
        cache = paged_cache(storage, layer)
        if cache is None or bs < 16 or bs & (bs - 1):
            return False
        from kvserve.kernels.triton_kv_write import KiviStep, kivi_write

        p = storage.step_plan(k.shape[0])
        step = KiviStep(*(p.on_device(n) for n in ("quant_blocks", "quant_src", "res_dst")))
        kivi_write(cache, step, k, v, self.key_scales(k.device))
        return True

    def key_scales(self, device: torch.device) -> torch.Tensor:
        """KIVI's 256 key-scale factors ``2 ** (-code / 8)`` by torch's ``exp2`` on
        ``device``, as the storage computes them."""
        table = self._key_scales.get(device)
        if table is None:
            steps = torch.arange(256, dtype=torch.float32, device=device)
            table = self._key_scales[device] = torch.exp2(-steps / KEY_SCALE_STEPS)
        return table

    def decode(self, layer, q, storage, block_tables, seq_lens, window, seq_windows):  # noqa: ANN001, ANN201
        cache = paged_cache(storage, layer)
        if cache is None:
            return None
        b = q.shape[0]
        out = torch.empty_like(q)
        rows = self.arange(b, q.device)
        # one query per sequence: rows 0..B-1, one each, at cache entry seq_len - 1
        self._attend(q, cache, out, rows, self.ones(b, q.device), seq_lens - 1, block_tables,
                     seq_windows, window, b, 1)  # fmt: skip
        return out

    def fused_group(
        self, layer: int, q: torch.Tensor, storage: KVStorage, group: PagedGroup,
        window: int | None, out: torch.Tensor, q_back: torch.Tensor | None,
    ) -> bool:  # fmt: skip
        if type(storage) is not DenseKVStorage:
            return False
        cache = paged_cache(storage, layer)
        if cache is None:
            return False
        votes = None if group.votes is None else group.votes.of_layer(layer)
        self._attend(q, cache, out, group.q_start, group.q_len, group.ctx_len,
                     group.block_tables, group.windows, window, group.num_rows, 1 << 30,
                     group.sinks, q_back, votes)  # fmt: skip
        return True

    def serves_retention(self, storage: KVStorage) -> bool:
        """The dense formats' group takes StreamingLLM's sinks and H2O's mass."""
        return type(storage) is DenseKVStorage and paged_cache(storage, 0) is not None
