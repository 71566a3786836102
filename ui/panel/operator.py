"""Who may run the load generator and see the block map's owners and hashes: the operator, never
a passing visitor.

Sixty-four synthetic users starve real chats, so on a shared server (a team machine, a public
Space) starting or stopping them is the operator's, decided from what each request proves: that
it was made on the machine of an app bound to a loopback address (its peer is loopback and it
carries no reverse proxy's header, engine/api/access.py's `made_here`: behind nginx or Caddy on
the same machine every visitor's peer is loopback too; and never on a Space), that it comes from
the Space's owner signed in with Hugging Face, or that it gives the admin token set in the
environment. Everyone else sees no controls, and the handlers (the API included) refuse them.
"""
from __future__ import annotations

import hmac
from collections.abc import Mapping

from engine import is_loopback, made_here

TOKEN_ENV = "PAGEDCHAT_ADMIN_TOKEN"
SPACE_ENV = "SPACE_ID"  # set on a Space, whose visitors all come through its proxy, whatever the bind
OWNER_ENV = "SPACE_AUTHOR_NAME"  # set by Hugging Face on a Space: the user or org that owns it
REFUSAL = ("The load generator is for the operator of this server: run the app on your own machine, "
           "sign in as the Space's owner, or give the admin token.")


def may_operate(bound_host: str | None, peer_host: str | None, headers: Mapping[str, str],
                profile_username: str | None, given_token: str | None, env: Mapping[str, str]) -> bool:
    """Whether this request may start and stop the load generator (see the module's docstring):
    `bound_host`, the address the app is bound to; `peer_host` and `headers`, the request's.
    An unset or empty token or owner name lets no one in by that way."""
    if is_loopback(bound_host) and not env.get(SPACE_ENV) and made_here(peer_host, headers):
        return True
    owner = env.get(OWNER_ENV) or ""
    if owner and profile_username and hmac.compare_digest(_bytes(profile_username), _bytes(owner)):
        return True
    token = env.get(TOKEN_ENV) or ""
    return bool(token and given_token) and hmac.compare_digest(_bytes(given_token), _bytes(token))


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate (JSON allows it) compares, never raises
