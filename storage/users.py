"""Users: a row per person who signs in; everything else hangs off it."""
from __future__ import annotations

from . import validation
from .connections import StoreBase
from .errors import NotFound
from .timestamps import now


class Users(StoreBase):
    def ensure_user(self, user_id: str, name: str | None = None) -> dict:
        """The user's row, created on first sight; a given name replaces the stored one."""
        validation.user_id(user_id)
        with self.transaction() as db:
            db["users"].insert({"id": user_id, "name": name, "created": now()}, ignore=True)
            if name is not None:
                db["users"].update(user_id, {"name": name})
            return db["users"].get(user_id)

    def user(self, user_id: str) -> dict:
        rows = list(self.db["users"].rows_where("id = ?", [user_id]))
        if not rows:
            raise NotFound("user", user_id)
        return rows[0]

    def delete_user(self, user_id: str) -> None:
        """The user and, by cascade, all their conversations and messages."""
        with self.transaction() as db:
            if db.execute("delete from users where id = ?", [user_id]).rowcount == 0:
                raise NotFound("user", user_id)
