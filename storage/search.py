"""Full-text search over a user's conversations: words in their messages or their titles.

Both tables carry an FTS5 index that triggers keep in step with every insert, update and
delete (cascades included). The query's words are quoted, so any text the user types is a
plain word search (all words must appear; "running" also finds "run"), never FTS syntax.
(sqlite-utils' `quote_fts` keeps typed "phrases" but fails on some input, such as `""`.)
"""
from __future__ import annotations

from .connections import StoreBase

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


def fts_words(query: str) -> str:
    """Each whitespace-separated word as an FTS5 string (quotes doubled): valid for any text."""
    return " ".join('"' + word.replace('"', '""') + '"' for word in query.split())


class Search(StoreBase):
    def search(self, user_id: str, query: str, limit: int = 20,
               highlight: tuple[str, str] = ("[", "]")) -> list[dict]:
        """The user's conversations matching every word of `query`, best match first, each
        with a `snippet` of the matching text, matched words wrapped in `highlight`."""
        if not query.strip():
            return []
        params = {"query": fts_words(query), "user_id": user_id, "limit": limit,
                  "open": highlight[0], "close": highlight[1], "words": 12}
        return list(self.db.query(SEARCH_SQL, params))
