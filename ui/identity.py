"""Who is chatting: an anonymous id kept in the browser, or the Hugging Face username on a Space.

Every Store call is keyed by this id. An anonymous id is 128 random bits, so it works as a
bearer secret: knowing it is what makes a browser its owner. A `hf:` id is only accepted from
the server-side OAuth profile, never from what the browser claims.

On a Space, signing in is offered, not required: a public demo that asks for an account first
loses most of its visitors, and an anonymous visitor's chats are already private to their
browser. Signing in moves the chats the browser wrote anonymously into the account (the browser
holds their id, so they are the signer's to take), where they follow the user to other browsers;
signing out leaves them with the account.

Since an anonymous id is whatever the browser (or a script) says, a turn also has an `Origin`:
its page and its client's address, which the chat's limits on replies in progress count too.
"""
from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping

import gradio as gr

from engine import client_address, made_here
from ui.turns import Origin
from ui.space import on_space

ANONYMOUS = re.compile(r"anon:[0-9a-f]{32}")


def new_anonymous_id() -> str:
    return f"anon:{uuid.uuid4().hex}"


def is_anonymous_id(value: object) -> bool:
    return isinstance(value, str) and ANONYMOUS.fullmatch(value) is not None


def resolve_user(claimed: str | None, profile: gr.OAuthProfile | None = None) -> str:
    """The id to use for this event: the signed-in username, else the browser's anonymous id."""
    if profile is not None:
        return f"hf:{profile.username}"
    if is_anonymous_id(claimed):
        return claimed
    raise gr.Error("Your browser session has no user id yet: reload the page.")


def origin_of(request: gr.Request | None, env: Mapping[str, str] = os.environ) -> Origin:
    """Where an event comes from: its Gradio session, and the client's address — the one a
    proxy says it forwarded for where the peer is a proxy on this machine (or the Space's front,
    whose visitors all come through it), else the peer's own. A request made on this machine
    itself (a loopback peer, no proxy's header) has none: it is the operator's, or a benchmark's."""
    if request is None:
        return Origin()
    peer = request.client.host if request.client is not None else None
    headers = request.headers
    address = None if made_here(peer, headers) else client_address(peer, headers, proxy_trusted=on_space(env))
    return Origin(request.session_hash, address)
