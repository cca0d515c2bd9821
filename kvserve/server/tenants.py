"""API keys, tenants, and the prefix-cache salt derived from them.

A prefix-cache hit is observably faster than a miss, so a tenant that could share cache
blocks with another could probe which prompts the other sent. The salt that partitions the
cache is therefore derived here, on the server, from the *authenticated* tenant: an HMAC of
(tenant, client salt) under a server secret (random per process, or ``$KVSERVE_TENANT_SECRET``
shared by replicas). A client may still send ``cache_salt`` to split its own traffic further,
but it only ever selects a partition inside its own tenant, and because the secret never leaves
the servers no client can compute another tenant's salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from kvserve import envs
from kvserve.server.api_errors import APIError

DEFAULT_TENANT = "default"
OPEN_SERVER_SECRET = b"kvserve-open-server"


class TenantResolver:
    """Maps a ``Authorization: Bearer KEY`` header to a tenant name.

    With no keys configured the server is open and every request belongs to ``default``.
    """

    def __init__(self, keys: dict[str, str] | None = None, secret: bytes | None = None) -> None:
        self._keys = dict(keys or {})
        self._secret = secret if secret is not None else os.urandom(32)

    @classmethod
    def from_args(cls, api_key: str | None, tenants_file: str | None) -> TenantResolver:
        """Keys from ``--api-key`` / ``--tenants``; the secret from ``$KVSERVE_TENANT_SECRET``
        when set (replicas that share an offload tier share it, so a tenant's prefix is a hit
        on every replica and another tenant's never is), else random per process. An open
        server (no keys) has one tenant whose salts anyone can choose anyway: it uses a fixed
        secret, so its entries in a disk or Redis tier outlive a restart."""
        keys: dict[str, str] = {}
        if tenants_file:
            keys.update(load_tenants(tenants_file))
        if api_key:
            keys.setdefault(api_key, DEFAULT_TENANT)
        secret = envs.KVSERVE_TENANT_SECRET  # at least 16 characters, or None
        if secret is None and not keys:
            return cls(keys, OPEN_SERVER_SECRET)
        return cls(keys, secret.encode() if secret is not None else None)

    @property
    def auth_required(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of a request, or a 401. Every key is compared in constant time so the
        response time does not reveal how much of a guessed key was right."""
        if not self._keys:
            return DEFAULT_TENANT
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        token = token.strip()
        tenant = None
        for key, name in self._keys.items():
            if hmac.compare_digest(key.encode(), token.encode()):
                tenant = name
        if tenant is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant

    def cache_salt(self, tenant: str, client_salt: str | None) -> str:
        """The engine's ``cache_salt``: distinct tenants never share one, whatever clients send."""
        msg = json.dumps([tenant, client_salt]).encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()


def load_tenants(path: str | Path) -> dict[str, str]:
    """Read ``--tenants FILE``: a JSON object ``{"API_KEY": "tenant-name", ...}``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"tenants: file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"tenants: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f'tenants: {path} must be a JSON object {{"API_KEY": "tenant", ...}}')
    for key, name in data.items():
        if not key.strip() or not isinstance(name, str) or not name.strip():
            raise ValueError(f"tenants: {path}: keys and tenant names must be non-empty strings")
    return data
