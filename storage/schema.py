"""The tables, as a sequence of migrations (sqlite-utils' `Migrations`).

The schema version of a database is the number of these migrations applied to it; opening a
database applies whatever is pending, so an older file is upgraded in place and an up-to-date
one is left alone. To change the schema later, append a migration; never edit an applied one.
"""
from __future__ import annotations

from sqlite_utils import Database, Migrations

migrations = Migrations("pagedchat")


TABLES = """
create table users (
    id text primary key,
    name text,
    created text not null
);
create table conversations (
    id integer primary key autoincrement,  -- never reused: a stale id cannot reach a newer chat
    user_id text not null references users(id) on delete cascade,
    title text not null check (trim(title) != ''),
    system_prompt text not null default '',
    model text,
    created text not null,
    updated text not null
);
create table messages (
    id integer primary key autoincrement,
    conversation_id integer not null references conversations(id) on delete cascade,
    role text not null check (role in ('system', 'user', 'assistant')),
    content text not null,
    prompt_tokens integer,
    cached_tokens integer,
    completion_tokens integer,
    ttft_s real,
    tokens_per_s real,
    finish_reason text,
    stopped integer not null default 0 check (stopped in (0, 1)),  -- stopped by the user
    created text not null
);
"""


@migrations()
def create_tables(db: Database) -> None:
    """Version 1: users, their conversations, the messages in them, full-text search."""
    db.executescript(TABLES)
    db["conversations"].create_index(["user_id", "updated"])
    db["messages"].create_index(["conversation_id"])
    db["conversations"].enable_fts(["title"], create_triggers=True, tokenize="porter")
    db["messages"].enable_fts(["content"], create_triggers=True, tokenize="porter")


@migrations()
def drop_conversation_model(db: Database) -> None:
    """Version 2: conversations lose `model`, which the app never wrote."""
    # In place (SQLite 3.35+), keeping rows, ids and FTS triggers: rebuilding the table
    # (sqlite-utils' transform) drops the old one, and with foreign keys on that cascades to messages.
    db.execute("alter table conversations drop column model")


@migrations()
def add_message_backend(db: Database) -> None:
    """Version 3: `messages.backend`, the server that wrote a reply when the app fronts several
    (its next turn goes back there, where its KV blocks are); NULL for the in-process engine."""
    db.execute("alter table messages add column backend text")


@migrations()
def add_message_branches(db: Database) -> None:
    """Version 4: branches. A message's `parent_id` is the message it follows (NULL for a
    conversation's first); regenerating a reply or editing a message adds a sibling instead of
    deleting, and `conversations.leaf_id` marks the end of the branch shown. Existing messages
    become one branch: each follows the one before it."""
    db.execute("alter table messages add column parent_id integer references messages(id) on delete cascade")
    db.execute("alter table conversations add column leaf_id integer references messages(id) on delete set null")
    db.execute("""update messages set parent_id = (
        select max(earlier.id) from messages earlier
        where earlier.conversation_id = messages.conversation_id and earlier.id < messages.id)""")
    db.execute("update conversations set leaf_id = (select max(id) from messages where conversation_id = conversations.id)")
    db["messages"].create_index(["parent_id"])


@migrations()
def add_context_fitting(db: Database) -> None:
    """Version 5: `conversations.fit_context` (1: when the next turn would not fit the model's
    context, leave out the oldest turns instead of refusing) and `messages.left_out` (how many
    of the oldest messages a reply was written without; NULL: none)."""
    db.execute("alter table conversations add column fit_context integer not null default 0 "
               "check (fit_context in (0, 1))")
    db.execute("alter table messages add column left_out integer")


def migrate(db: Database, steps: Migrations = migrations) -> None:
    """Apply pending migrations in one write transaction, so that two processes opening the
    same file at once cannot both apply them."""
    db.execute("BEGIN IMMEDIATE")
    try:
        steps.apply(db)
    except BaseException:
        db.rollback()
        raise
    db.commit()


def schema_version(db: Database, steps: Migrations = migrations) -> int:
    """How many of the migrations in `steps` this database has had applied (0 when empty)."""
    return len(steps.applied(db))
