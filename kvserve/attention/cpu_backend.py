"""The CPU backend: the C kernels of :mod:`kvserve.kernels` where they apply, the reference
(:class:`~kvserve.attention.torch_backend.TorchBackend`) wherever they decline.

What it serves, call by call:

- decode rows and the paged group (decode rows, short continuation chunks, retention's rows)
  straight from the blocks, for the KV formats in :data:`FORMAT_KERNELS` and the geometries
  each kernel takes (the kernels' ``supports``: dtypes, head and block sizes, query heads
  per KV head); only the dense format has the fused group kernel, and with it H2O's mass
  and StreamingLLM's sinks;
- prefill chunks of any format: those that start a sequence over their fresh K/V, those that
  continue one over the gathered context (:mod:`kvserve.kernels.prefill`, which declines
  float16, odd head sizes and layouts it does not take).

The table is keyed by the storage's exact class: a wrapper or a subclass may change what a
read sees, and only the reference path, through ``gather``, honours that. The kernels are
switched off by ``KVSERVE_DISABLE_KERNELS=1`` (or ``kernels.DISABLED``) or missing where no C
compiler is found; every call then declines.
"""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.attention.metadata import PagedGroup
from kvserve.attention.torch_backend import TorchBackend
from kvserve.kernels import pointwise, prefill, quant
from kvserve.kv import codecs
from kvserve.kv.kivi_storage import KiviKVStorage
from kvserve.kv.quant_storage import Fp8KVStorage, Int8KVStorage
from kvserve.kv.storage import DenseKVStorage, KVStorage


class FormatKernels:
    """One KV format's kernels, reading the storage's own tensors; each method declines
    (None / False) where its kernel does not take the call."""

    def decode(
        self, st: KVStorage, layer: int, q: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, window: int | None, seq_windows: torch.Tensor | None,
    ) -> torch.Tensor | None:  # fmt: skip
        return None

    def group(
        self, st: KVStorage, layer: int, q: torch.Tensor, group: PagedGroup,
        window: int | None, out: torch.Tensor, q_back: torch.Tensor | None,
    ) -> bool:  # fmt: skip
        return False

    def serves_retention(self, st: KVStorage) -> bool:
        return False

    def write(
        self, st: KVStorage, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        return False


class DenseKernels(FormatKernels):
    """``paged_attention.c`` over full-precision blocks: decode rows, and the fused group
    with H2O's mass (``votes``) and StreamingLLM's sinks."""

    def decode(self, st, layer, q, block_tables, seq_lens, window, seq_windows):  # noqa: ANN001, ANN201
        if not _dense_applies(st, q.shape[1] // st.num_kv_heads):
            return None
        return kernels.paged_decode_attention(
            q, st.k[layer], st.v[layer], block_tables, seq_lens, window, seq_windows
        )

    def group(self, st, layer, q, group, window, out, q_back) -> bool:  # noqa: ANN001
        if not _dense_applies(st, q.shape[1] // st.num_kv_heads):
            return False
        votes = group.votes
        votes = None if votes is None else votes.of_layer(layer)
        kernels.paged_attention(q, st.k[layer], st.v[layer], group, window, out, votes, q_back)
        return True

    def serves_retention(self, st: KVStorage) -> bool:
        return _dense_applies(st, 1)

    def write(self, st, layer, slots, k, v) -> bool:  # noqa: ANN001
        """The dense write kernel (one pass, no index tensors)."""
        return pointwise.kv_write(st.k[layer], st.v[layer], slots, k, v)


def _dense_applies(st: KVStorage, q_per_kv: int) -> bool:
    return kernels.supports(st.dtype, st.device, q_per_kv, st.head_dim, st.block_size)


class Fp8Kernels(FormatKernels):
    """``quant_attention.c`` decode over fp8 codes with per-(layer, KV head) scales."""

    def decode(self, st, layer, q, block_tables, seq_lens, window, seq_windows):  # noqa: ANN001, ANN201
        if not quant.supports(q, st.num_kv_heads, st.head_dim, st.block_size, st.device):
            return None
        view = st.kernel_views.get(layer)
        if view is None:
            view = quant.fp8_view(st.k_codes[layer], st.v_codes[layer], st.k_scale[layer],
                                  st.v_scale[layer], st.fp8_dtype)  # fmt: skip
            if st.calibrated[layer]:  # scales may still change until then: no caching
                st.kernel_views[layer] = view
        return quant.decode(view, q, block_tables, seq_lens, window, seq_windows=seq_windows)


class Int8Kernels(FormatKernels):
    """``quant_attention.c`` decode over int8 codes with per-token float16 scales."""

    def decode(self, st, layer, q, block_tables, seq_lens, window, seq_windows):  # noqa: ANN001, ANN201
        if not quant.supports(q, st.num_kv_heads, st.head_dim, st.block_size, st.device):
            return None
        view = st.kernel_views.get(layer)
        if view is None:
            view = st.kernel_views[layer] = quant.int8_view(
                st.k_codes[layer], st.v_codes[layer], st.k_scale[layer], st.v_scale[layer]
            )
        return quant.decode(view, q, block_tables, seq_lens, window, seq_windows=seq_windows)


class KiviKernels(FormatKernels):
    """``quant_attention.c`` decode over KIVI's codes, partial blocks read from the
    full-precision residual, queries rotated into the keys' Hadamard basis."""

    def decode(self, st, layer, q, block_tables, seq_lens, window, seq_windows):  # noqa: ANN001, ANN201
        rk, rv = st.res_k[layer], st.res_v[layer]
        if not quant.supports(q, st.num_kv_heads, st.head_dim, st.block_size, st.device, rk.dtype):
            return None
        view = st.kernel_views.get(layer)
        if view is None:
            view = st.kernel_views[layer] = quant.kivi_view(
                st.k_codes[layer], st.v_codes[layer], st.k_meta[layer], st.k_base[layer],
                st.v_scale[layer], st.v_zero[layer], st.bits, st.group, st.head_dim,
                codecs.KEY_SCALE_STEPS,
            )  # fmt: skip
        return quant.decode(view, q, block_tables, seq_lens, window, (st.res_of_block_t, rk, rv),
                            st.key_rotation, seq_windows)  # fmt: skip


# The formats this backend has kernels for, by storage class; any other storage (a wrapper,
# a format without kernels) is attended by the reference.
FORMAT_KERNELS: dict[type[KVStorage], FormatKernels] = {
    DenseKVStorage: DenseKernels(),
    Fp8KVStorage: Fp8Kernels(),
    Int8KVStorage: Int8Kernels(),
    KiviKVStorage: KiviKernels(),
}
_NONE = FormatKernels()


class CpuBackend(TorchBackend):
    name = "cpu"
    device_types = frozenset({"cpu"})
    auto_priority = 10  # ahead of the reference wherever the kernels build

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return cls.runs_on(device) and kernels.native_available()

    def serves_retention(self, storage: KVStorage) -> bool:
        return FORMAT_KERNELS.get(type(storage), _NONE).serves_retention(storage)

    def write_kv(self, layer, storage, slot_mapping, k, v) -> bool:  # noqa: ANN001
        fk = FORMAT_KERNELS.get(type(storage), _NONE)
        return fk.write(storage, layer, slot_mapping, k, v)

    def fused_group(self, layer, q, storage, group, window, out, q_back) -> bool:  # noqa: ANN001
        fk = FORMAT_KERNELS.get(type(storage), _NONE)
        return fk.group(storage, layer, q, group, window, out, q_back)

    def decode(self, layer, q, storage, block_tables, seq_lens, window, seq_windows):  # noqa: ANN001, ANN201
        fk = FORMAT_KERNELS.get(type(storage), _NONE)
        return fk.decode(storage, layer, q, block_tables, seq_lens, window, seq_windows)

    def causal_prefill(self, q, k, v, out, window) -> bool:  # noqa: ANN001
        return prefill.prefill_attention(q, k, v, out, window)

    def context_prefill(self, q, k, v, out, window) -> bool:  # noqa: ANN001
        return prefill.context_attention(q, k, v, out, window)
