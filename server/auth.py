"""API keys and tenants. With keys configured, every /v1 request needs `Authorization: Bearer
<key>`, and the key decides the tenant: its files, and the salt in its cache keys. The tenant is
an HMAC of the key under a secret made at start-up, so it never reveals the key, differs per
server process, and two keys never share cached KV.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from mmkv.errors import MMKVError


class AuthenticationError(MMKVError):
    http_status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class KeyRing:
    """The accepted keys. Immutable after construction, so safe to share across threads."""

    def __init__(self, api_keys: tuple[str, ...] = (), secret: bytes | None = None):
        if any(not k for k in api_keys):
            raise ValueError("API keys must be non-empty strings")
        self._keys = tuple(k.encode() for k in api_keys)
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenants(self) -> tuple[str, ...]:
        """Every key's tenant ("" alone when keys are off)."""
        return tuple(self._tenant(k) for k in self._keys) if self._keys else ("",)

    def _tenant(self, key: bytes) -> str:
        return hmac.new(self._secret, key, hashlib.sha256).hexdigest()[:32]

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of a request's Authorization header; "" when keys are off.
        Raises AuthenticationError on a missing or unknown key."""
        if not self._keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        key = token.strip().encode()
        # Compare against every key so the time taken does not say which one nearly matched.
        if not any([hmac.compare_digest(key, k) for k in self._keys]):
            raise AuthenticationError("incorrect API key provided")
        return self._tenant(key)
