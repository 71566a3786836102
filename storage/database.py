"""Where the database lives, how a connection is opened, and how threads share the file.

Each thread gets its own connection to the same file (SQLite connections are not meant to be
shared between threads); WAL lets readers run alongside the one writer. Every write runs in a
`BEGIN IMMEDIATE` transaction: it takes the write lock up front, so concurrent writers queue
on the busy timeout instead of failing with "database is locked" when a read turns into a write.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlite_utils import Database

DEFAULT_PATH = "data/pagedchat.db"
BUSY_TIMEOUT_S = 30.0


def default_path() -> Path:
    """`$PAGEDCHAT_DB`, or ./data/pagedchat.db."""
    return Path(os.environ.get("PAGEDCHAT_DB") or DEFAULT_PATH)


def connect(path: str | os.PathLike) -> Database:
    """One connection: foreign keys enforced, a busy timeout, transactions only where we ask."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    db = Database(conn)
    db.execute("PRAGMA foreign_keys = ON")
    # With WAL, NORMAL never leaves half a transaction; only a power loss can drop the latest commits.
    db.execute("PRAGMA synchronous = NORMAL")
    return db


class Connections:
    """One database file in WAL mode: a connection per thread, and transactions on it."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._open: weakref.WeakSet[Database] = weakref.WeakSet()  # a finished thread's goes too
        self._lock = threading.Lock()
        self._closed = False
        self.db.enable_wal()

    @property
    def db(self) -> Database:
        """This thread's connection, opened on first use."""
        db = getattr(self._local, "db", None)
        if db is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"the store at {self.path} is closed")
                db = self._local.db = connect(self.path)
                self._open.add(db)
        return db

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        """All writes inside happen together or not at all; nested blocks become savepoints."""
        db = self.db
        if db.conn.in_transaction:
            with db.atomic():
                yield db
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.commit()
        except BaseException:
            db.rollback()
            raise

    @contextlib.contextmanager
    def reading(self) -> Iterator[Database]:
        """Several reads from one snapshot of the database."""
        db = self.db
        if db.conn.in_transaction:
            yield db
            return
        db.execute("BEGIN")
        try:
            yield db
        finally:
            db.rollback()

    def close(self) -> None:
        """Close every thread's connection; none can be opened afterwards."""
        with self._lock:
            self._closed = True
            for db in list(self._open):
                db.close()
            self._open.clear()
        self._local = threading.local()


_clock_lock = threading.Lock()
_last_stamp = datetime.min.replace(tzinfo=timezone.utc)


def now() -> str:
    """ISO 8601 in UTC, strictly increasing within the process: "newest first" is never a tie,
    even for two writes in the same microsecond, and the text sorts as the time does."""
    global _last_stamp
    with _clock_lock:
        moment = max(datetime.now(timezone.utc), _last_stamp + timedelta(microseconds=1))
        _last_stamp = moment
    return moment.isoformat(timespec="microseconds")
