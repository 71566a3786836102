"""`Store`: the chat app's storage, one object for all threads."""
from __future__ import annotations

import os

from .connections import StoreBase
from .conversations import Conversations
from .messages import Messages
from .schema import migrate, schema_version
from .search import Search
from .users import Users


class Store(Users, Conversations, Messages, Search):
    """Users, conversations and messages in one SQLite file; every call names the user.

        store = Store()  # $PAGEDCHAT_DB, or ./data/pagedchat.db; Store(path) for another file
        chat = store.create_conversation("ada", title="Paged attention")
        store.add_message("ada", chat["id"], "user", "How do KV blocks work?")
        store.search("ada", "blocks")  # [{...chat, "snippet": "How do KV [blocks] work?"}]
    """

    def __init__(self, path: str | os.PathLike | None = None):
        StoreBase.__init__(self, path)
        self.db.enable_wal()
        migrate(self.db)

    @property
    def schema_version(self) -> int:
        return schema_version(self.db)
