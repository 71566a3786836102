"""Who is chatting: an anonymous id kept in the browser, or the Hugging Face username on a Space.

Every Store call is keyed by this id. An anonymous id is 128 random bits, so it works as a
bearer secret: knowing it is what makes a browser its owner. A `hf:` id is only accepted from
the server-side OAuth profile, never from what the browser claims.

On a Space, signing in is offered, not required: a public demo that asks for an account first
loses most of its visitors, and an anonymous visitor's chats are already private to their
browser. Signing in moves the chats the browser wrote anonymously into the account (the browser
holds their id, so they are the signer's to take), where they follow the user to other browsers;
signing out leaves them with the account.
"""
from __future__ import annotations

import re
import uuid

import gradio as gr

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
