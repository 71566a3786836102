"""Who has a reply in progress: one per conversation, and at most a few per user, per page and
per client address, so that no one (a script minting user ids included) can fill the engine's
queue alone. A turn beyond any of them is refused with a message, before anything is stored.

An anonymous user id is whatever the browser (or a script) says, so a turn also has an `Origin`:
its page (Gradio session) and its client's address, counted as the user is.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ui.chat_input import ChatInputError

MAX_REPLIES_PER_USER = 4  # replies one user may have in progress at once, across their chats
MAX_REPLIES_PER_SESSION = MAX_REPLIES_PER_USER  # per page (Gradio session): one page is one user
MAX_REPLIES_PER_ADDRESS = 16  # per client address: a few people behind one network, or one script
BUSY = "A reply is still being written in this chat: wait for it or press Stop."
TOO_MANY = (f"You already have {MAX_REPLIES_PER_USER} replies being written: wait for one to finish "
            "(or stop one), then try again. Nothing was sent.")
TOO_MANY_IN_PAGE = (f"This page already has {MAX_REPLIES_PER_SESSION} replies being written: wait for one to "
                    "finish (or stop one), then try again. Nothing was sent.")
TOO_MANY_FROM_ADDRESS = (f"{MAX_REPLIES_PER_ADDRESS} replies are already being written for your network address: "
                         "wait for one to finish (or stop one), then try again. Nothing was sent.")


@dataclass(frozen=True)
class Origin:
    """Where a turn comes from, beyond the user id it claims: its page (Gradio's session hash)
    and its client's address (ui/identity.py's `origin_of`). None where unknown, and an address
    of None for a request made on this machine itself, which is not limited per address."""
    session: str | None = None
    address: str | None = None


ANYWHERE = Origin()  # a caller in this process (tests, tools): limited per user only


class Turn:
    """One reply's hold on its reply slots (its user's, page's and address's) and its
    conversation; `release()` may be called any number of times."""

    def __init__(self, turns: Turns, user: str, slots: list[tuple[str, str]]) -> None:
        self._turns, self.user = turns, user
        self._held: list[int] = []
        self._slots = slots  # Turns.start took them
        self._lock = threading.Lock()

    def hold(self, conversation_id: int) -> None:
        """Hold `conversation_id`, or ChatInputError(BUSY) if another reply holds it."""
        self._turns._take(self.user, conversation_id)
        with self._lock:
            self._held.append(conversation_id)

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            slots, self._slots = self._slots, []
        for conversation_id in held:
            self._turns._release(self.user, conversation_id)
        self._turns._free_slots(slots)


class Turns:
    """The replies in progress: one per conversation, at most `max_per_user` per user, and as
    many per page and per client address; thread-safe. Conversations are keyed with their owner,
    so asking about another user's id says nothing."""

    def __init__(self, max_per_user: int = MAX_REPLIES_PER_USER, max_per_session: int = MAX_REPLIES_PER_SESSION,
                 max_per_address: int = MAX_REPLIES_PER_ADDRESS) -> None:
        # slot kind -> (most at once, the refusal beyond it)
        self._limits = {"user": (max_per_user, TOO_MANY), "session": (max_per_session, TOO_MANY_IN_PAGE),
                        "address": (max_per_address, TOO_MANY_FROM_ADDRESS)}
        self._lock = threading.Lock()
        # (user, conversation) with a reply in progress -> set once that reply has ended and been stored
        self._replying: dict[tuple[str, int], threading.Event] = {}
        self._in_progress: dict[tuple[str, str], int] = {}  # (kind, key) -> replies in progress

    def start(self, user: str, conversation_id: int | None, origin: Origin = ANYWHERE) -> Turn:
        """A turn holding a slot of the user's, of its page's and of its address's, and
        `conversation_id` (a new conversation is held once created); TOO_MANY (or the page's or
        the address's refusal) or BUSY if it may not start."""
        slots = [("user", user)] + [(kind, key) for kind, key in (("session", origin.session),
                                                                 ("address", origin.address)) if key]
        with self._lock:
            for slot in slots:
                most, refusal = self._limits[slot[0]]
                if self._in_progress.get(slot, 0) >= most:
                    raise ChatInputError(refusal)
            for slot in slots:
                self._in_progress[slot] = self._in_progress.get(slot, 0) + 1
        turn = Turn(self, user, slots)
        if conversation_id is not None:
            try:
                turn.hold(conversation_id)
            except BaseException:
                turn.release()
                raise
        return turn

    def busy(self, user: str, conversation_id: int | None) -> bool:
        with self._lock:
            return (user, conversation_id) in self._replying

    def in_progress(self, user: str) -> int:
        """The user's replies in progress now."""
        with self._lock:
            return self._in_progress.get(("user", user), 0)

    def wait(self, user: str, conversation_id: int | None, timeout: float) -> None:
        """Until the conversation's reply (if any) has ended and been stored, or `timeout`."""
        with self._lock:
            ended = self._replying.get((user, conversation_id))
        if ended is not None:
            ended.wait(timeout=timeout)

    def _take(self, user: str, conversation_id: int) -> None:
        with self._lock:
            if (user, conversation_id) in self._replying:
                raise ChatInputError(BUSY)
            self._replying[(user, conversation_id)] = threading.Event()

    def _release(self, user: str, conversation_id: int) -> None:
        with self._lock:
            ended = self._replying.pop((user, conversation_id))
        ended.set()

    def _free_slots(self, slots: list[tuple[str, str]]) -> None:
        with self._lock:
            for slot in slots:
                left = self._in_progress[slot] - 1
                if left:
                    self._in_progress[slot] = left
                else:
                    del self._in_progress[slot]
