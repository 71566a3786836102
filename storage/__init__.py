"""The chat app's storage: users, conversations and messages in SQLite, via sqlite-utils.

Knows nothing of the engine or the UI. Every read and write names a user id, and another
user's rows behave as missing (`NotFound`). Safe to share between threads.
"""
from .database import connect, default_path
from .schema import migrate, migrations, schema_version
from .store import NotFound, Store
from .validation import METRICS, ROLES

__all__ = ["Store", "NotFound", "connect", "default_path", "migrate", "migrations",
           "schema_version", "METRICS", "ROLES"]
