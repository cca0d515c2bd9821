"""Which connectors an engine runs, built the same way on both sides: the offload tiers when
``--kv-offload-*`` asks for them, then the user's connector when ``kv_transfer_config`` names
one; several compose into a :class:`~kvserve.connectors.multi.MultiConnector`."""

from __future__ import annotations

import importlib

from kvserve.config import BUILTIN_CONNECTORS, ConfigError, EngineConfig
from kvserve.connectors.base import KVConnector, Role
from kvserve.connectors.multi import MultiConnector
from kvserve.connectors.offload import OffloadConnector
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import OffloadTiers


def user_connector_class(config: EngineConfig) -> type[KVConnector] | None:
    """The class ``kv_transfer_config`` names, imported (ConfigError naming the field when it
    cannot be)."""
    tc = config.kv_transfer_config
    if not tc.kv_connector:
        return None
    path = tc.kv_connector_module_path or BUILTIN_CONNECTORS.get(tc.kv_connector, "")
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ConfigError(f"kv_connector_module_path: cannot import "
                          f"{tc.kv_connector_module_path!r}: {e}") from None  # fmt: skip
    cls = getattr(module, tc.kv_connector, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ConfigError(f"kv_connector: {tc.kv_connector!r} in {path!r} "
                          "is not a kvserve.connectors.base.KVConnector")  # fmt: skip
    return cls


def _compose(role: Role, connectors: list[KVConnector]) -> KVConnector | None:
    if not connectors:
        return None
    return connectors[0] if len(connectors) == 1 else MultiConnector(role, connectors)


def scheduler_connector(
    config: EngineConfig, kv: KVCacheManager, tiers: OffloadTiers | None
) -> KVConnector | None:
    """The scheduler side of the engine's connectors (None: no connector moves KV)."""
    out: list[KVConnector] = []
    if tiers is not None:
        out.append(OffloadConnector(Role.SCHEDULER, kv, tiers))
    cls = user_connector_class(config)
    if cls is not None:
        out.append(cls(Role.SCHEDULER, config))
    return _compose(Role.SCHEDULER, out)


def worker_connector(config: EngineConfig) -> KVConnector | None:
    """The worker side, in the same order as :func:`scheduler_connector`'s."""
    out: list[KVConnector] = []
    if config.cache.kv_offload:
        out.append(OffloadConnector(Role.WORKER))
    cls = user_connector_class(config)
    if cls is not None:
        out.append(cls(Role.WORKER, config))
    return _compose(Role.WORKER, out)
