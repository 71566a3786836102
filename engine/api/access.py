"""What a request proves about who sent it, and so who may reach the API: an address only this
machine can reach, or a caller with the key. The chat app's panel decides its operator from the
same facts (ui/panel/operator.py).

A request proves it was made on this machine only when its peer is a loopback address AND it
carries none of the headers a reverse proxy adds: nginx or Caddy in front of an app bound to
127.0.0.1 is a loopback peer too, and it forwards anyone's requests. (A proxy that adds none of
them cannot be told from a local client: forward X-Forwarded-For, as nginx's usual
`proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for` and Caddy by default do.)
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping

from fastapi import Request

from engine.api.errors import APIError

# Headers a reverse proxy adds; whoever sends one says the request was forwarded.
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip")
LOCAL_CALLER = "local"


def is_loopback(host: str | None) -> bool:
    """Whether `host` (an address a server is bound to, or a peer's) is this machine's alone."""
    if not host:
        return False
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def through_proxy(headers: Mapping[str, str]) -> bool:
    """Whether a request carries a header that a reverse proxy adds."""
    names = {name.lower() for name in headers.keys()}
    return any(name in names for name in PROXY_HEADERS)


def made_here(peer_host: str | None, headers: Mapping[str, str]) -> bool:
    """Whether a request proves it was made on this machine itself, not forwarded to it: its peer
    is a loopback address and it carries no proxy header."""
    return is_loopback(peer_host) and not through_proxy(headers)


def forwarded_for(headers: Mapping[str, str]) -> str | None:
    """The client address the nearest proxy says it forwarded for: the last X-Forwarded-For
    entry (the one it appended; those before it are the client's own to write), else the last
    `for=` of Forwarded (RFC 7239), else X-Real-IP; None without any."""
    lowered = {name.lower(): value for name, value in headers.items()}
    entries = [e.strip() for e in lowered.get("x-forwarded-for", "").split(",") if e.strip()]
    if entries:
        return entries[-1]
    fors = [part.strip()[4:].strip('"') for element in lowered.get("forwarded", "").split(",")
            for part in element.split(";") if part.strip().lower().startswith("for=")]
    if fors and fors[-1]:
        return fors[-1]
    return lowered.get("x-real-ip", "").strip() or None


def client_address(peer_host: str | None, headers: Mapping[str, str], proxy_trusted: bool = False) -> str | None:
    """The address to count a client's requests by: the forwarded-for address when the peer is a
    proxy (one on this machine, or any peer when `proxy_trusted`, as a Space's front is), else the
    peer. A client that reaches the server directly cannot choose it."""
    if (is_loopback(peer_host) or proxy_trusted) and through_proxy(headers):
        return forwarded_for(headers) or peer_host
    return peer_host


def api_caller(request: Request) -> str:
    """Who an API request is from, as far as keeping callers apart goes: `key:<hash>` of the
    bearer key it gives (checked by `bearer_key_check` where the server has one; the key itself
    never appears), else `local`, a caller on this machine."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return LOCAL_CALLER
    return "key:" + hashlib.sha256(_bytes(token.strip())).hexdigest()[:16]


def bearer_key_check(api_key: str | None):
    """A FastAPI dependency that wants `Authorization: Bearer <api_key>` (vLLM's rule). With no
    key, it lets in only requests made on this machine itself (`made_here`): the server is then
    bound to loopback, and a request that came through a proxy is anyone's."""
    def authorized(request: Request) -> None:
        if api_key is None:
            if not made_here(request.client.host if request.client else None, request.headers):
                raise APIError(401, "This server has no API key, so it answers only requests made on its own "
                                    "machine, and this one came through a proxy (it carries X-Forwarded-For, "
                                    "Forwarded or X-Real-IP) or from elsewhere: start the server with --api-key "
                                    "(or $PAGEDCHAT_API_KEY) and send it as `Authorization: Bearer <key>`.",
                               "authentication_error", code="invalid_api_key")
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(_bytes(token.strip()), _bytes(api_key)):
            raise APIError(401, "Missing or wrong API key: send it as `Authorization: Bearer <key>`.",
                           "authentication_error", code="invalid_api_key")
    return authorized


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate (JSON allows it) compares, never raises
