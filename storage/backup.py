"""Snapshots of the database file, for a host whose disk does not outlive it (a Space).

A snapshot is taken with SQLite's online backup API, which copies a consistent state of the
database while other connections keep writing (WAL mode: it sees every committed transaction up
to the moment it starts, none half-done). It is written to a temporary file and renamed onto one
fixed name, so whoever uploads the folder (huggingface_hub's CommitScheduler) never reads a
half-written file; older versions live in the upload target's history, not on disk.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

SNAPSHOT_NAME = "pagedchat.db"
log = logging.getLogger("pagedchat.backup")


class CorruptSnapshot(ValueError):
    """A snapshot that fails SQLite's integrity check: restoring it would start the app on it."""


def snapshot(db_path: str | os.PathLike, folder: str | os.PathLike,
             lock: contextlib.AbstractContextManager | None = None) -> Path:
    """A consistent copy of the live database at `folder/pagedchat.db`; the rename onto that name
    happens under `lock` (the uploader's), if given."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not Path(db_path).exists():
        raise FileNotFoundError(f"no database at {db_path} to snapshot")
    target = folder / SNAPSHOT_NAME
    with _temporary_file(folder) as temporary:
        _copy(Path(db_path), temporary)
        with lock or contextlib.nullcontext():
            os.replace(temporary, target)
    return target


def restore(snapshot_path: str | os.PathLike, db_path: str | os.PathLike) -> bool:
    """Put the snapshot in place as the database, only if there is none yet (a live database is
    never overwritten). Returns whether it restored; raises `CorruptSnapshot` for a snapshot that
    fails the integrity check rather than start the app on it, and FileExistsError when a deleted
    database's write-ahead log (or rollback journal) is still beside `db_path`: SQLite would apply
    its pages to the restored file, which would then pass the integrity check with the wrong chats."""
    snapshot_path, db_path = Path(snapshot_path), Path(db_path)
    if db_path.exists() or not snapshot_path.exists():
        return False
    for leftover in (db_path.with_name(db_path.name + suffix) for suffix in ("-wal", "-journal")):
        if leftover.exists():
            raise FileExistsError(f"{leftover} is left from a deleted database; move it away to restore {db_path}")
    problem = integrity_problem(snapshot_path)
    if problem:
        raise CorruptSnapshot(f"the snapshot {snapshot_path} fails SQLite's integrity check: {problem}")
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with _temporary_file(db_path.parent) as temporary:
        _copy(snapshot_path, temporary)
        os.replace(temporary, db_path)
    return True


def integrity_problem(path: Path) -> str | None:
    """None for a sound database file, else what SQLite says is wrong with it."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as connection:
            rows = [row[0] for row in connection.execute("pragma integrity_check")]
    except sqlite3.DatabaseError as error:
        return str(error)
    return None if rows == ["ok"] else "; ".join(rows[:5])


class BackupLoop:
    """Snapshots `db_path` into `folder` every `interval_s` seconds when it changed, on a daemon
    thread. A failed snapshot is logged and retried at the next tick: backups never break a chat."""

    def __init__(self, db_path: str | os.PathLike, folder: str | os.PathLike, interval_s: float,
                 lock: contextlib.AbstractContextManager | None = None) -> None:
        self.db_path, self.folder, self.interval_s, self.lock = Path(db_path), Path(folder), interval_s, lock
        self.snapshots = 0
        self.failures = 0
        self._taken: int | None = None  # the data_version the last snapshot saw
        self._watch: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # the thread's tick and stop()'s last snapshot never overlap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedchat-backup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.take_if_changed()

    def take_if_changed(self) -> bool:
        """A snapshot if the database changed since the last one; whether one was taken."""
        with self._lock:
            try:
                version = self._version()
                if version is None or version == self._taken:
                    return False
                snapshot(self.db_path, self.folder, self.lock)
                self._taken = version
                self.snapshots += 1
                return True
            except Exception:  # noqa: BLE001 (any failure is logged and retried; the chat goes on)
                self.failures += 1
                log.exception("database snapshot into %s failed; retrying in %.0f s", self.folder, self.interval_s)
                return False

    def _version(self) -> int | None:
        """SQLite's `data_version` on a connection kept for it: it changes whenever another
        connection, in this process or another, commits (and after a checkpoint that resets the WAL: one
        needless snapshot), never otherwise, and reading it blocks no writer. Read before the
        snapshot, so a commit that lands during one is caught at the next tick. (The files' sizes
        and mtimes can miss a commit: a WAL reused after a checkpoint keeps its size, and an older
        kernel's mtimes are coarse, so the last reply before a restart could go unsaved.)"""
        if self._watch is None:
            if not self.db_path.exists():
                return None
            # mode=rw: never creates the database; autocommit: never holds a read open between ticks.
            self._watch = sqlite3.connect(f"file:{self.db_path}?mode=rw", uri=True, isolation_level=None,
                                          check_same_thread=False)
        return self._watch.execute("pragma data_version").fetchone()[0]

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread, then take a last snapshot of whatever changed since the previous one."""
        self._stop.set()
        self._thread.join(timeout)
        self.take_if_changed()
        with self._lock:
            if self._watch is not None:
                self._watch.close()
                self._watch = None


@contextlib.contextmanager
def _temporary_file(folder: Path) -> Iterator[Path]:
    descriptor, name = tempfile.mkstemp(prefix=".snapshot-", suffix=".tmp", dir=folder)
    os.close(descriptor)
    try:
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _copy(source: Path, target: Path) -> None:
    """SQLite's online backup of `source` into `target` (replaced); a self-contained file, no WAL."""
    with contextlib.closing(sqlite3.connect(source)) as reader, contextlib.closing(sqlite3.connect(target)) as writer:
        reader.backup(writer)
        writer.execute("pragma journal_mode=delete")  # the copy stands alone, with no -wal beside it
