"""Who may reach an API: an address only this machine can reach, or a caller with the key."""
from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request

from engine.api.errors import APIError


def is_loopback(host: str | None) -> bool:
    """Whether a server bound to `host` is reachable only from this machine."""
    if not host:
        return False
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_key_check(api_key: str | None):
    """A FastAPI dependency that wants `Authorization: Bearer <api_key>` (vLLM's rule); with no
    key, it lets everyone in."""
    def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"),
                                                                 api_key.encode("utf-8", "surrogatepass")):
            raise APIError(401, "Missing or wrong API key: send it as `Authorization: Bearer <key>`.",
                           "authentication_error", code="invalid_api_key")
    return authorized
