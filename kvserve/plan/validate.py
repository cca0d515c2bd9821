"""``kvserve plan --validate``: the planner's prediction against what a live engine allocates.

The planner's bytes per token come from the engine's own accounting, so comparing its block
count with the engine's, or with a byte count the storage computes itself, would only show
that one function agrees with itself. The figures checked here come from outside it:

* the bytes of every tensor the engine's storage object holds, measured from the tensors
  (each distinct allocation once), never from the storage's own byte methods;
* for the dense formats, the closed form 2 x layers x KV heads x head dim x element size x
  block size x blocks, which needs no engine code at all.

The engine also allocates a few bytes that do not scale with blocks (quantization scales,
KIVI's residual pool, the null block that pads block tables); the planner predicts them with
the formats' fixed-byte figure, and the predicted total must match the measured total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig
from kvserve.config_fields import default_of
from kvserve.plan.capacity import blocks_for, bytes_per_token, format_table, load_arch

# The engine's default; KIVI's residual pool, and so its block count, depends on it.
VALIDATE_MAX_NUM_SEQS = 256
REL_TOL = 0.01


@dataclass(slots=True)
class ValidationRow:
    """One format: predicted and engine blocks; ``predicted_bytes`` is the predicted total
    (blocks x block size x bytes per token + fixed bytes) and ``engine_bytes`` the bytes the
    engine's storage tensors really occupy."""

    kv_cache_dtype: str
    predicted_blocks: int
    engine_blocks: int | None
    predicted_bytes: float
    engine_bytes: int | None
    ok: bool
    reason: str = ""
    predicted_fixed_bytes: int = 0
    closed_form_bytes: int | None = None  # dense formats: 2 L H D itemsize x bs x blocks


def owned_tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors ``obj`` holds in its attributes (tensors, and lists, tuples and
    dicts of them, nested), each underlying allocation counted once however many views
    share it. Objects of other types are not entered: a kernel's view of the cache or a
    block pool owns no KV bytes of its own."""
    import torch

    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                values.append(getattr(obj, name))
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    while values:
        v = values.pop()
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            if s.nbytes():
                storages[(str(v.device), s.data_ptr())] = s.nbytes()
        elif isinstance(v, list | tuple | dict) and id(v) not in seen:
            seen.add(id(v))
            values.extend(v.values() if isinstance(v, dict) else v)
    return sum(storages.values())


def dense_closed_form_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int, block_size: int, blocks: int
) -> int:
    """K and V of every layer, head and token slot, in a dense dtype of ``itemsize`` bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize * block_size * blocks


def build_engine(
    model_dir: str, fmt: str, memory_bytes: int, block_size: int, dtype: str, device: str,
    max_model_len: int,
) -> Any:  # fmt: skip
    """The engine ``--validate`` measures: ``memory_bytes`` of KV in format ``fmt``."""
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=model_dir,
            dtype=dtype,
            device=device,
            cache=CacheConfig(
                block_size=block_size, kv_cache_memory=memory_bytes, kv_cache_dtype=fmt
            ),
            scheduler=SchedulerConfig(
                max_model_len=max_model_len, max_num_seqs=VALIDATE_MAX_NUM_SEQS
            ),
        )
    )


def validate(
    model_dir: str,
    memory_bytes: int,
    block_size: int = default_of(EngineConfig, "block_size"),
    dtype: str = default_of(EngineConfig, "dtype"),
    device: str = default_of(EngineConfig, "device"),
) -> list[ValidationRow]:
    """Build the engine once per implemented storage format with ``memory_bytes`` of KV and
    check, each within 1 %, that the planner's block count is the engine's, that its total
    bytes are what the engine's storage tensors occupy, and (dense formats) that its
    per-block bytes are the closed form's. A format the accounting knows but the engine
    refuses is a failure: the two must land together. So is a storage that owns no bytes."""
    import torch

    from kvserve.config import ModelConfig
    from kvserve.kv.formats import canonical_kv_format, kv_fixed_bytes
    from kvserve.kv.storage import TORCH_DTYPES
    from kvserve.model.dtype import choose_dtype, is_gguf_dir

    spec = load_arch(model_dir)
    mc = ModelConfig.from_pretrained(model_dir)
    compute_dtype = choose_dtype(dtype, mc, device, is_gguf_dir(model_dir)).dtype
    compute = str(compute_dtype).removeprefix("torch.")
    L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    ok, _ = format_table(spec)
    rows = []
    for fmt in ok:
        name = canonical_kv_format(fmt, compute)
        bpt = bytes_per_token(spec, fmt, model_dtype=compute)
        fixed = kv_fixed_bytes(name, L, H, D, compute_dtype, block_size, VALIDATE_MAX_NUM_SEQS)
        pred = blocks_for(memory_bytes - fixed, bpt, block_size)
        row = ValidationRow(fmt, pred, None, pred * block_size * bpt + fixed, None, False,
                            predicted_fixed_bytes=fixed)  # fmt: skip
        try:
            engine = build_engine(
                model_dir, fmt, memory_bytes, block_size, dtype, device,
                min(256, spec.max_position_embeddings),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any refusal is a validation failure to report
            row.reason = f"engine refused: {e}"
            rows.append(row)
            continue
        row.engine_blocks = engine.num_blocks
        row.engine_bytes = engine.executor.collective_rpc(_pool_bytes)[0]
        if name in TORCH_DTYPES and not spec.is_mla:
            itemsize = torch.empty((), dtype=TORCH_DTYPES[name]).element_size()
            row.closed_form_bytes = dense_closed_form_bytes(
                L, H, D, itemsize, block_size, engine.num_blocks
            )
        row.reason = _mismatch(row, block_size * bpt)
        row.ok = not row.reason
        rows.append(row)
        engine.shutdown()
        del engine
    return rows


def _mismatch(row: ValidationRow, block_bytes: float) -> str:
    """Why ``row`` fails, or "" when every figure agrees within 1 %."""
    assert row.engine_blocks is not None and row.engine_bytes is not None
    if not row.engine_bytes:
        return "the engine's storage owns no tensor bytes"
    if not math.isclose(row.predicted_blocks, row.engine_blocks, rel_tol=REL_TOL):
        return f"blocks differ by more than 1 %: {row.predicted_blocks} vs {row.engine_blocks}"
    if not math.isclose(row.predicted_bytes, row.engine_bytes, rel_tol=REL_TOL):
        return (
            f"allocated bytes differ by more than 1 %: {row.predicted_bytes:.0f} predicted "
            f"({row.predicted_fixed_bytes} fixed), {row.engine_bytes} in the storage's tensors"
        )
    per_block = row.predicted_blocks * block_bytes
    if row.closed_form_bytes is not None and not math.isclose(
        per_block, row.closed_form_bytes, rel_tol=REL_TOL
    ):
        return (
            f"per-block bytes differ from the dense closed form by more than 1 %: "
            f"{per_block:.0f} predicted, {row.closed_form_bytes} = 2 x layers x KV heads x "
            f"head dim x element size x block size x {row.engine_blocks} blocks"
        )
    return ""


@dataclass(slots=True)
class WindowCheck:
    """A model with sliding-window layers: the planner's window-aware bytes for one sequence
    of ``context`` tokens against the bytes of the blocks a live engine holds for it (dense
    ``auto`` format). The engine holds whole blocks: each full-attention layer up to one
    block more than its tokens, each window layer up to two (the block its oldest query
    starts in and the one being filled), which is the allowed ``slack_bytes``."""

    context: int
    predicted_bytes: float
    engine_bytes: int
    slack_bytes: float
    ok: bool


def _pool_bytes(worker: Any) -> int:
    """The bytes a worker's KV storage tensors occupy."""
    return owned_tensor_bytes(worker.storage)


def _pool_bytes_per_row(worker: Any) -> float:
    """A worker's KV bytes per block row (the usable blocks and the null block alike)."""
    storage = worker.storage
    return owned_tensor_bytes(storage) / (storage.num_blocks + 1)


def validate_windows(
    model_dir: str,
    block_size: int = default_of(EngineConfig, "block_size"),
    dtype: str = default_of(EngineConfig, "dtype"),
    device: str = default_of(EngineConfig, "device"),
) -> WindowCheck | None:
    """Run one sequence past the widest window and compare what the engine's pool holds
    with :func:`~kvserve.plan.capacity.capacity`'s window-aware figure (None: the model has
    no sliding-window layer)."""
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.engine import LLMEngine
    from kvserve.plan.capacity import capacity
    from kvserve.sched.request import SamplingParams

    spec = load_arch(model_dir)
    windows = [w for w in spec.layer_windows if w]
    if not windows:
        return None
    context = min(2 * max(windows) + 3 * block_size, spec.max_position_embeddings - 2)
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            dtype=dtype,
            device=device,
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_model_len=context + 2, max_num_seqs=1),
        )
    )
    vocab = min(spec.vocab_size, 1000)
    prompt = [(7 * i + 3) % vocab for i in range(context - 1)]
    engine.add_request("w", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.requests["w"].num_computed_tokens < context:  # the prompt, then one token
        engine.step()
    per_row = engine.executor.collective_rpc(_pool_bytes_per_row)[0]
    held = engine.kv.pool.num_used_blocks * per_row
    while engine.has_unfinished_requests():
        engine.step()
    cap = capacity(spec, engine.kv_cache_dtype, 1e12, context)
    per_layer_block = cap.kv_bytes_per_token / spec.num_layers * block_size
    slack = per_layer_block * sum(2 if w else 1 for w in spec.layer_windows)
    pred = cap.kv_bytes_per_sequence_window_aware
    return WindowCheck(context, pred, int(held), slack, pred <= held <= pred + slack)
