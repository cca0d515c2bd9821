"""How many KV blocks the pool gets, and the checkpoint identity its cache keys carry."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from kvserve.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    SchedulerConfig,
    user_cache_dir,
)
from kvserve.kv.formats import pool_num_blocks
from kvserve.kv.manager import cdiv

DEFAULT_KV_CACHE_MEMORY = 4 * 1024**3


def model_fingerprint(model_dir: Path) -> str:
    """A stable identity of a checkpoint for prefix-cache keys and exported KV: a hash of its
    config and of the *content* of its weight files, so two checkpoints with the same shapes
    and other weights never share an entry. Hashing reads every weight byte once; the result
    is kept in the user cache, keyed by the files' paths, sizes and modification times."""
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    where = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:24]
    cache = user_cache_dir() / "fingerprints" / f"{where}.json"
    try:
        saved = json.loads(cache.read_text())
        if saved.get("stamp") == [list(s) for s in stamp]:
            return str(saved["fingerprint"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0".encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    fingerprint = h.hexdigest()[:32]
    try:  # the cache only saves time; a read-only home directory is no error
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "fingerprint": fingerprint}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return fingerprint


def num_kv_blocks(
    cc: CacheConfig,
    sc: SchedulerConfig,
    mc: ModelConfig,
    kv_format: str,
    compute_dtype: torch.dtype,
    max_model_len: int,
    bytes_per_token: float,
    device: torch.device | None = None,
    num_kv_heads: int | None = None,
) -> int | None:
    """``num_gpu_blocks`` as given; else the blocks ``kv_cache_memory`` holds after the
    format's fixed bytes; else, on CUDA, None: the worker sizes the pool from the memory its
    profiling forward leaves under ``gpu_memory_utilization``
    (:class:`~kvserve.kv.gpu_budget.GpuMemoryBudget`);
    else (a CPU) enough for ``max_num_seqs`` full-length sequences, capped at 4 GiB.
    ``num_kv_heads``: the KV heads one tensor-parallel rank's pool holds (None: the model's),
    since each rank's pool gets the memory."""
    if cc.num_gpu_blocks is not None:
        return cc.num_gpu_blocks
    block_bytes = bytes_per_token * cc.block_size
    if cc.kv_cache_memory is not None:
        n = pool_num_blocks(
            cc.kv_cache_memory, kv_format, mc.num_hidden_layers,
            num_kv_heads or mc.num_key_value_heads,
            mc.head_dim, str(compute_dtype).removeprefix("torch."), cc.block_size,
            sc.max_num_seqs,
        )  # fmt: skip
        if n < 1:
            raise ConfigError(
                f"kv_cache_memory: {cc.kv_cache_memory} bytes holds no block of "
                f"{int(block_bytes)} bytes after the format's fixed bytes; give more, or "
                "lower max_num_seqs (KIVI keeps one full-precision block per sequence)"
            )
        return n
    if device is not None and device.type == "cuda":
        return None
    want = sc.max_num_seqs * cdiv(max_model_len, cc.block_size)
    return max(1, min(want, int(DEFAULT_KV_CACHE_MEMORY // block_bytes)))
