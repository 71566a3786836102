"""Messages in a conversation, in order, with the engine's numbers for each reply.

Adding, replacing or deleting messages also bumps the conversation's `updated`, in the same
transaction: a conversation is never seen with a message but a stale timestamp, or the reverse.
"""
from __future__ import annotations

from sqlite_utils import Database

from . import validation
from .connections import StoreBase
from .conversations import owned_conversation
from .errors import NotFound
from .timestamps import now


def _message(row: dict) -> dict:
    return {**row, "stopped": bool(row["stopped"])}


class Messages(StoreBase):
    def add_message(self, user_id: str, conversation_id: int, role: str, content: str,
                    **metrics) -> dict:
        """Append a message. Metrics: prompt_tokens, cached_tokens, completion_tokens, ttft_s,
        tokens_per_s, finish_reason, stopped (a reply the user stopped: store the text they
        saw; its finish_reason is "abort")."""
        row = {"role": validation.role(role), "content": validation.content(content),
               **validation.metrics(metrics)}
        with self.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            return self._append(db, conversation_id, row)

    def messages(self, user_id: str, conversation_id: int) -> list[dict]:
        """The conversation's messages, oldest first."""
        with self._reading() as db:
            owned_conversation(db, user_id, conversation_id)
            rows = db["messages"].rows_where("conversation_id = ?", [conversation_id], order_by="id")
            return [_message(row) for row in rows]

    def chat_history(self, user_id: str, conversation_id: int) -> list[dict]:
        """The conversation as chat messages ({"role", "content"}), its system prompt first."""
        with self._reading():
            conversation = self.conversation(user_id, conversation_id)
            system = ([{"role": "system", "content": conversation["system_prompt"]}]
                      if conversation["system_prompt"].strip() else [])
            return system + [{"role": m["role"], "content": m["content"]}
                             for m in self.messages(user_id, conversation_id)]

    def replace_last_assistant(self, user_id: str, conversation_id: int, content: str,
                               **metrics) -> dict:
        """Swap the conversation's final reply for a regenerated one, in one transaction."""
        row = {"role": "assistant", "content": validation.content(content),
               **validation.metrics(metrics)}
        with self.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            last = self._last(db, conversation_id)
            if last is None or last["role"] != "assistant":
                raise NotFound("assistant reply at the end of conversation", conversation_id)
            db["messages"].delete(last["id"])
            return self._append(db, conversation_id, row)

    def edit_last_user_message(self, user_id: str, conversation_id: int, content: str) -> dict:
        """Replace the user's last message, dropping the reply that followed it, so that the
        edited message can be sent again."""
        row = {"role": "user", "content": validation.content(content), **validation.metrics({})}
        with self.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            last_user = self._last(db, conversation_id, role="user")
            if last_user is None:
                raise NotFound("user message in conversation", conversation_id)
            self._delete_from(db, conversation_id, last_user["id"])
            return self._append(db, conversation_id, row)

    def delete_messages_from(self, user_id: str, conversation_id: int, message_id: int) -> int:
        """Delete this message and every later one in its conversation; how many went."""
        with self.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            if not db["messages"].count_where("id = ? and conversation_id = ?",
                                              [message_id, conversation_id]):
                raise NotFound("message", message_id)
            deleted = self._delete_from(db, conversation_id, message_id)
            self._touch(db, conversation_id)
            return deleted

    def _append(self, db: Database, conversation_id: int, row: dict) -> dict:
        row = {**row, "conversation_id": conversation_id, "created": now()}
        message_id = db["messages"].insert(row).last_pk
        self._touch(db, conversation_id)
        return _message(db["messages"].get(message_id))

    def _touch(self, db: Database, conversation_id: int) -> None:
        db["conversations"].update(conversation_id, {"updated": now()})

    @staticmethod
    def _last(db: Database, conversation_id: int, role: str | None = None) -> dict | None:
        """The conversation's last message (of `role`, if given), or None."""
        where, args = "conversation_id = ?", [conversation_id]
        if role is not None:
            where, args = where + " and role = ?", args + [role]
        return next(db["messages"].rows_where(where, args, order_by="id desc", limit=1), None)

    @staticmethod
    def _delete_from(db: Database, conversation_id: int, message_id: int) -> int:
        return db.execute("delete from messages where conversation_id = ? and id >= ?",
                          [conversation_id, message_id]).rowcount
