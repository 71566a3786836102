"""Conversations, each owned by one user: every query names the owner, so another user's
conversation is indistinguishable from a missing one."""
from __future__ import annotations

from sqlite_utils import Database

from . import validation
from .connections import StoreBase
from .errors import NotFound
from .timestamps import now

OWNED = "id = ? and user_id = ?"


def owned_conversation(db: Database, user_id: str, conversation_id: int) -> dict:
    """The conversation if `user_id` owns it, else NotFound."""
    rows = list(db["conversations"].rows_where(OWNED, [conversation_id, user_id]))
    if not rows:
        raise NotFound("conversation", conversation_id)
    return rows[0]


class Conversations(StoreBase):
    def create_conversation(self, user_id: str, title: str = "New chat", system_prompt: str = "",
                            model: str | None = None) -> dict:
        """A new, empty conversation for the user (whose row is created if need be)."""
        row = {"user_id": validation.user_id(user_id), "title": validation.title(title),
               "system_prompt": validation.text(system_prompt, "system prompt"), "model": model}
        with self.transaction() as db:
            db["users"].insert({"id": user_id, "created": now()}, ignore=True)
            stamp = now()
            conversation_id = db["conversations"].insert({**row, "created": stamp, "updated": stamp}).last_pk
            return db["conversations"].get(conversation_id)

    def conversations(self, user_id: str, limit: int | None = None) -> list[dict]:
        """The user's conversations, the most recently updated first."""
        return list(self.db["conversations"].rows_where(
            "user_id = ?", [user_id], order_by="updated desc, id desc", limit=limit))

    def conversation(self, user_id: str, conversation_id: int) -> dict:
        return owned_conversation(self.db, user_id, conversation_id)

    def rename(self, user_id: str, conversation_id: int, title: str) -> dict:
        return self._change(user_id, conversation_id, title=validation.title(title))

    def set_system_prompt(self, user_id: str, conversation_id: int, system_prompt: str) -> dict:
        return self._change(user_id, conversation_id,
                            system_prompt=validation.text(system_prompt, "system prompt"))

    def set_model(self, user_id: str, conversation_id: int, model: str | None) -> dict:
        return self._change(user_id, conversation_id, model=model)

    def delete_conversation(self, user_id: str, conversation_id: int) -> None:
        """The conversation and, by cascade, its messages."""
        with self.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            db["conversations"].delete(conversation_id)

    def _change(self, user_id: str, conversation_id: int, **fields) -> dict:
        with self.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            db["conversations"].update(conversation_id, {**fields, "updated": now()})
            return db["conversations"].get(conversation_id)
