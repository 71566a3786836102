"""`Store`: the chat app's storage, one object for all threads.

Every query names the user, so another user's conversation is indistinguishable from a missing
one. Adding, replacing or deleting messages also bumps the conversation's `updated`, in the same
transaction: a conversation is never seen with a message but a stale timestamp, or the reverse.
"""
from __future__ import annotations

import contextlib
import os

from sqlite_utils import Database

from . import validation
from .database import Connections, now
from .schema import migrate


class NotFound(KeyError):
    """A conversation or message that does not exist *for this user*.

    Another user's conversation reads exactly like a missing one: the message never says
    whether the row exists elsewhere.
    """

    def __init__(self, what: str, key: object):
        self.what = what
        self.key = key
        super().__init__(f"{what} {key!r} not found")

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return self.args[0]


# Full-text search: both tables carry an FTS5 index that triggers keep in step with every
# insert, update and delete (cascades included).
BRANCH_SQL = """
with recursive branch(id, depth) as (  -- from the leaf up to the conversation's first message
    select :leaf, 0
    union all
    select messages.parent_id, branch.depth + 1 from messages join branch on messages.id = branch.id
    where messages.parent_id is not null
)
select messages.*,
       (select count(*) from messages sibling where sibling.conversation_id = messages.conversation_id
          and sibling.parent_id is messages.parent_id and sibling.id <= messages.id) as version,
       (select count(*) from messages sibling where sibling.conversation_id = messages.conversation_id
          and sibling.parent_id is messages.parent_id) as versions,
       (select max(id) from messages sibling where sibling.conversation_id = messages.conversation_id
          and sibling.parent_id is messages.parent_id and sibling.id < messages.id) as previous_version_id,
       (select min(id) from messages sibling where sibling.conversation_id = messages.conversation_id
          and sibling.parent_id is messages.parent_id and sibling.id > messages.id) as next_version_id
from branch join messages on messages.id = branch.id
order by branch.depth desc
"""
SEARCH_SQL = """
with hits as (
    select conversations.id as conversation_id, messages_fts.rank as rank,
           snippet(messages_fts, 0, :open, :close, '…', :words) as snippet
    from messages_fts
    join messages on messages.id = messages_fts.rowid
    join conversations on conversations.id = messages.conversation_id
    where messages_fts match :query and conversations.user_id = :user_id
    union all
    select conversations.id, conversations_fts.rank,
           snippet(conversations_fts, 0, :open, :close, '…', :words)
    from conversations_fts
    join conversations on conversations.id = conversations_fts.rowid
    where conversations_fts match :query and conversations.user_id = :user_id
),
best as (  -- per conversation, the snippet of its best-ranked hit
    select conversation_id, snippet, min(rank) as rank from hits group by conversation_id
)
select conversations.*, best.snippet
from best join conversations on conversations.id = best.conversation_id
order by best.rank, conversations.updated desc
limit :limit
"""


class Store:
    """Users, conversations and messages in one SQLite file; every call names the user.

        store = Store()  # $PAGEDCHAT_DB, or ./data/pagedchat.db; Store(path) for another file
        chat = store.create_conversation("ada", title="Paged attention")
        store.add_message("ada", chat["id"], "user", "How do KV blocks work?")
        store.search("ada", "blocks")  # [{...chat, "snippet": "How do KV [blocks] work?"}]
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.connections = Connections(path)
        self.path = self.connections.path
        migrate(self.db)

    @property
    def db(self) -> Database:
        """This thread's connection."""
        return self.connections.db

    def close(self) -> None:
        """Close every thread's connection; the store cannot be used afterwards."""
        self.connections.close()

    def transaction(self) -> contextlib.AbstractContextManager[Database]:
        """Several calls as one: all of them are stored, or (on an exception) none.

            with store.transaction():
                chat = store.create_conversation("ada", title="Hello")
                store.add_message("ada", chat["id"], "user", "Hello")
        """
        return self.connections.transaction()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- all of a user's conversations at once (the user's row comes with their first) ---------

    def delete_conversations(self, user_id: str) -> int:
        """All of the user's conversations (and, by cascade, their messages); returns how many.
        The user's row stays: signing in again finds an empty list, not an error."""
        with self.connections.transaction() as db:
            return db.execute("delete from conversations where user_id = ?", [user_id]).rowcount

    def move_conversations(self, from_user: str, to_user: str) -> int:
        """Give all of `from_user`'s conversations (and their messages) to `to_user`, whose row is
        created if need be; returns how many moved. The caller has checked that it speaks for
        both (a browser signing in with the anonymous id it holds)."""
        validation.user_id(from_user)
        validation.user_id(to_user)
        with self.connections.transaction() as db:
            db["users"].insert({"id": to_user, "created": now()}, ignore=True)
            return db.execute("update conversations set user_id = ? where user_id = ?",
                              [to_user, from_user]).rowcount

    # --- conversations --------------------------------------------------------------------------

    def create_conversation(self, user_id: str, title: str = "New chat", system_prompt: str = "") -> dict:
        """A new, empty conversation for the user (whose row is created if need be)."""
        row = {"user_id": validation.user_id(user_id), "title": validation.title(title),
               "system_prompt": validation.text(system_prompt, "system prompt")}
        with self.connections.transaction() as db:
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

    def set_fit_context(self, user_id: str, conversation_id: int, on: bool) -> dict:
        """Whether the conversation leaves out its oldest turns when the next would not fit."""
        return self._change(user_id, conversation_id, fit_context=int(bool(on)))

    def delete_conversation(self, user_id: str, conversation_id: int) -> None:
        """The conversation and, by cascade, its messages."""
        with self.connections.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            db["conversations"].delete(conversation_id)

    def _change(self, user_id: str, conversation_id: int, **fields) -> dict:
        with self.connections.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            db["conversations"].update(conversation_id, {**fields, "updated": now()})
            return db["conversations"].get(conversation_id)

    # --- messages, in order, with the engine's numbers for each reply --------------------------

    def add_message(self, user_id: str, conversation_id: int, role: str, content: str,
                    **metrics) -> dict:
        """Append a message to the branch shown. Metrics: prompt_tokens, cached_tokens,
        completion_tokens, ttft_s, tokens_per_s, finish_reason, stopped (a reply the user
        stopped: store the text they saw; its finish_reason is "abort"), backend (the server
        that wrote it)."""
        row = {"role": validation.role(role), "content": validation.content(content),
               **validation.metrics(metrics)}
        with self.connections.transaction() as db:
            conversation = owned_conversation(db, user_id, conversation_id)
            return self._append(db, conversation_id, row, parent_id=conversation["leaf_id"])

    def messages(self, user_id: str, conversation_id: int) -> list[dict]:
        """The branch shown, oldest first. Each message carries `version` and `versions`: its
        place among the messages that follow the same one (a reply and its regenerations, a
        message and its edits), for a `‹ 2/3 ›`, and `previous_version_id`/`next_version_id`
        (None at either end) for `show_version`."""
        with self.connections.reading() as db:
            leaf_id = owned_conversation(db, user_id, conversation_id)["leaf_id"]
            return [_message(row) for row in db.query(BRANCH_SQL, {"leaf": leaf_id})] if leaf_id else []

    def replace_last_assistant(self, user_id: str, conversation_id: int, content: str,
                               **metrics) -> dict:
        """A regenerated reply: a new version of the branch's final reply, shown in its place;
        the earlier versions are kept (`show_version` goes back to one)."""
        row = {"role": "assistant", "content": validation.content(content),
               **validation.metrics(metrics)}
        with self.connections.transaction() as db:
            leaf = _leaf(db, owned_conversation(db, user_id, conversation_id))
            if leaf is None or leaf["role"] != "assistant":
                raise NotFound("assistant reply at the end of conversation", conversation_id)
            return self._append(db, conversation_id, row, parent_id=leaf["parent_id"])

    def edit_message(self, user_id: str, conversation_id: int, message_id: int, content: str) -> dict:
        """A new version of one of the user's messages, anywhere in the conversation: the branch
        shown forks there and ends with it, to be answered; what followed the old version is kept
        on its own branch."""
        row = {"role": "user", "content": validation.content(content), **validation.metrics({})}
        with self.connections.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            original = _conversation_message(db, conversation_id, message_id)
            if original["role"] != "user":
                raise ValueError(f"only the user's own messages can be edited; message {message_id} is the "
                                 f"{original['role']}'s")
            return self._append(db, conversation_id, row, parent_id=original["parent_id"])

    def show_version(self, user_id: str, conversation_id: int, message_id: int) -> list[dict]:
        """Show the branch through `message_id` (one version of a message): it continues down the
        newest message after each one, as the conversation last went on from there. Returns the
        branch now shown, as `messages` does."""
        with self.connections.transaction() as db:
            owned_conversation(db, user_id, conversation_id)
            leaf_id = _conversation_message(db, conversation_id, message_id)["id"]
            while (child := db.execute("select max(id) from messages where parent_id = ?", [leaf_id]).fetchone()[0]):
                leaf_id = child
            db["conversations"].update(conversation_id, {"leaf_id": leaf_id})
        return self.messages(user_id, conversation_id)

    def _append(self, db: Database, conversation_id: int, row: dict, parent_id: int | None) -> dict:
        row = {**row, "conversation_id": conversation_id, "parent_id": parent_id, "created": now()}
        message_id = db["messages"].insert(row).last_pk
        db["conversations"].update(conversation_id, {"leaf_id": message_id})
        self._touch(db, conversation_id)
        return _message(db["messages"].get(message_id))

    def _touch(self, db: Database, conversation_id: int) -> None:
        db["conversations"].update(conversation_id, {"updated": now()})

    # --- search ---------------------------------------------------------------------------------

    def search(self, user_id: str, query: str, limit: int = 20,
               highlight: tuple[str, str] = ("[", "]")) -> list[dict]:
        """The user's conversations matching every word of `query` in their messages or titles,
        best match first, each with a `snippet` of the matching text, matched words wrapped in
        `highlight`. "running" also finds "run"."""
        if not query.strip():
            return []
        params = {"query": fts_words(query), "user_id": user_id, "limit": limit,
                  "open": highlight[0], "close": highlight[1], "words": 12}
        return list(self.db.query(SEARCH_SQL, params))


def owned_conversation(db: Database, user_id: str, conversation_id: int) -> dict:
    """The conversation if `user_id` owns it, else NotFound."""
    rows = list(db["conversations"].rows_where("id = ? and user_id = ?", [conversation_id, user_id]))
    if not rows:
        raise NotFound("conversation", conversation_id)
    return rows[0]


def _message(row: dict) -> dict:
    return {**row, "stopped": bool(row["stopped"])}


def _leaf(db: Database, conversation: dict) -> dict | None:
    """The last message of the branch shown, or None in an empty conversation."""
    return db["messages"].get(conversation["leaf_id"]) if conversation["leaf_id"] else None


def _conversation_message(db: Database, conversation_id: int, message_id: int) -> dict:
    rows = list(db["messages"].rows_where("id = ? and conversation_id = ?", [message_id, conversation_id]))
    if not rows:
        raise NotFound("message in conversation", message_id)
    return rows[0]


def fts_words(query: str) -> str:
    """Each whitespace-separated word as an FTS5 string (quotes doubled), so any text the user
    types is a plain word search, never FTS syntax. (sqlite-utils' `quote_fts` keeps typed
    "phrases" but fails on some input, such as `""`.)"""
    return " ".join('"' + word.replace('"', '""') + '"' for word in query.split())
