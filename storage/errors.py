"""The one error the storage layer raises for a missing row."""
from __future__ import annotations


class NotFound(KeyError):
    """A user, conversation or message that does not exist *for this user*.

    Another user's conversation reads exactly like a missing one: the message never says
    whether the row exists elsewhere.
    """

    def __init__(self, what: str, key: object):
        self.what = what
        self.key = key
        super().__init__(f"{what} {key!r} not found")

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return self.args[0]
