"""The offload tiers an engine config asks for, checked at start so a bad flag fails there."""

from __future__ import annotations

import torch

from kvserve.config import CacheConfig, ConfigError
from kvserve.kernels.openmp import usable_cpus
from kvserve.kv.hashing import BlockHash
from kvserve.kv.offload import KVOffload, OffloadTiers, tier_namespace
from kvserve.kv.redis_tier import RedisTier
from kvserve.kv.tiers import DiskTier, HostTier, Tier
from kvserve.worker.worker import WorkerInfo

LOAD_TIMEOUTS = 10  # a load gives up after this many tier-operation timeouts


def compute_takes_every_core(device: str) -> bool:
    """Whether an engine on ``device`` computes with every core this process may run on (a
    CPU engine at its default threads): its offload worker then has no core of its own."""
    return torch.device(device).type == "cpu" and torch.get_num_threads() >= usable_cpus()


def build_offload(
    cc: CacheConfig, worker: WorkerInfo | None, root: BlockHash, bytes_per_token: float
) -> KVOffload | None:
    """Host, disk and Redis tiers (fastest first) for ``cc``, or None when none is set.
    Raises :class:`ConfigError` naming the field: a bad URL or directory, a size below one
    block, an engine whose KV lives in a custom runner."""
    if not cc.kv_offload:
        return None
    if worker is None:
        raise ConfigError("kv_offload_*: tiers need the engine's own model runner and storage")
    block_bytes = int(bytes_per_token * cc.block_size)
    tiers: list[Tier] = []
    try:
        for name, field, size in tier_sizes(cc):
            check_tier_size(field, size, block_bytes)
            if name == "cpu":
                tiers.append(HostTier(size))
            elif name == "disk":
                tiers.append(DiskTier(cc.kv_offload_disk, size))
            else:
                tiers.append(RedisTier(cc.kv_offload_redis, size, cc.kv_offload_timeout))
    except ValueError as e:
        for t in tiers:
            t.close()
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from e
    namespace = tier_namespace(root, worker.storage_identity, worker.pool_state)
    offload = KVOffload(
        tiers, namespace, worker.storage_identity,
        load_timeout_s=LOAD_TIMEOUTS * cc.kv_offload_timeout, pin_memory=worker.pins_host_memory,
        inline_host_loads=compute_takes_every_core(worker.device),
    )  # fmt: skip
    apply_policies(offload, cc)
    return offload


def tier_sizes(cc: CacheConfig) -> list[tuple[str, str, int]]:
    """(tier name, its size field, bytes) of each tier ``cc`` asks for, fastest first: the
    order loads try them in."""
    wanted = (
        ("cpu", "kv_offload_cpu", cc.kv_offload_cpu),
        ("disk", "kv_offload_disk_size", cc.kv_offload_disk and cc.kv_offload_disk_size),
        ("redis", "kv_offload_redis_size", cc.kv_offload_redis and cc.kv_offload_redis_size),
    )
    return [(name, field, int(size)) for name, field, size in wanted if size]


def apply_policies(offload: OffloadTiers, cc: CacheConfig) -> None:
    """The config's write policy and preemption mode, on real or modelled tiers alike."""
    offload.write_through_hits = {
        "write_back": None,
        "write_through": 0,
        "write_through_selective": cc.kv_offload_reuse_threshold,
    }[cc.kv_offload_write_policy]
    offload.swap_preempted = cc.preemption_mode == "swap"


def check_tier_size(field: str, size: int | str, block_bytes: int) -> None:
    if int(size) < block_bytes:
        raise ConfigError(
            f"{field}: {size} bytes is smaller than one KV block ({block_bytes} bytes with this "
            f"model, format and block size)"
        )
