"""Synthetic chat users for the live engine panel.

A person watching the KV-cache panel while chatting alone sees one request at a time. This
module starts N synthetic users that chat in loops through the same `EngineClient` the app
uses, so batching, prefix-cache hits (a long system prompt shared by every user, and each
turn's prompt extending the previous turn's), preemption and swapping show up within seconds;
`stop()` aborts their requests and ends them.

Each user is a daemon thread running conversations of `turns_per_conversation` turns, then
starting afresh. Everything a user asks and samples is chosen deterministically from its index,
its conversation count and the turn, so different users ask different things at the same
moment and a run can be replayed.

Request ids are `load{generation}-u{user}-c{conversation}/t{turn}`: the panel takes the part
before the first "/" as the conversation key when it tints blocks, and `generation` counts
`start()` calls, so an id never repeats (the client refuses an id that is still running).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

from engine import SamplingParams, StreamingClient

log = logging.getLogger(__name__)

MAX_USERS = 64
MAX_TOKENS_LIMIT = 512

LOAD_SYSTEM_PROMPT = (
    "You are a friendly, patient and knowledgeable assistant who helps people with everyday "
    "questions about science, history, cooking, travel, language, programming and personal "
    "organization. Read each question carefully and answer the question that was actually asked. "
    "Keep your answers short and clear: start with the direct answer in one or two sentences, "
    "then add a brief explanation or a small example only when it makes the answer easier to "
    "understand. Use plain English and avoid jargon; when a technical term is necessary, explain "
    "it in simple words the first time you use it. If a question is ambiguous, state the most "
    "reasonable interpretation and answer that, and mention the other reading in one sentence. "
    "If you do not know something, or if the answer depends on facts you cannot check, say so "
    "honestly instead of guessing, and suggest where the person could find a reliable answer. "
    "Never invent quotations, statistics, dates or sources. When you give steps or instructions, "
    "number them and keep each step to a single action. When the person asks for a list, give "
    "at most five items unless they ask for more. Be respectful and encouraging, and never make "
    "the person feel foolish for asking. Do not give medical, legal or financial advice beyond "
    "general information, and recommend a qualified professional when the stakes are high. "
    "Remember what was said earlier in the conversation and stay consistent with it; if the "
    "person corrects you, thank them and use the correction from then on. Finally, keep a warm "
    "and calm tone, and end your answer without asking follow-up questions unless something "
    "important is missing."
)

QUESTIONS = (
    "Why is the sky blue?",
    "How do I boil an egg so the yolk stays soft?",
    "What is the difference between weather and climate?",
    "Can you explain what a prime number is?",
    "What should I pack for a weekend hiking trip?",
    "Who built the first printing press in Europe?",
    "How does a refrigerator keep food cold?",
    "What is a good way to start learning Python?",
    "Why do leaves change color in autumn?",
    "How can I remember people's names better?",
    "What causes the tides in the ocean?",
    "How do I make a simple tomato sauce?",
    "What is the meaning of the word 'serendipity'?",
    "How far away is the Moon?",
    "What is a binary search and when is it useful?",
    "Why do cats purr?",
    "How should I plan my study time before an exam?",
    "What was the Silk Road?",
    "How do vaccines train the immune system?",
    "Can you suggest a short stretching routine for the morning?",
)

_RETRY_WAIT_S = 1.0  # after a refused fresh conversation or an error: never spin


@dataclass(frozen=True)
class LoadStatus:
    running: bool
    users: int            # users started by the latest start() (0 before any)
    replies: int          # replies that finished (stop or length) since the latest start()
    refused: int          # submits the engine refused (conversation too long for the cache, ...)
    errors: int           # replies that ended in "error", or unexpected exceptions
    last_error: str | None


@dataclass
class _Run:
    """One start(): its users share this stop event and count into these counters."""
    generation: int
    users: int
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    in_flight: dict[int, str] = field(default_factory=dict)  # user index -> request id
    replies: int = 0
    refused: int = 0
    errors: int = 0
    last_error: str | None = None


class LoadGenerator:
    """Starts and stops a set of synthetic users on `client`."""

    def __init__(self, client: StreamingClient, *, think_time_s: float = 0.2, turns_per_conversation: int = 4) -> None:
        if not (isinstance(think_time_s, (int, float)) and think_time_s >= 0):
            raise ValueError(f"think_time_s must be a non-negative number, got {think_time_s!r}")
        if not (isinstance(turns_per_conversation, int) and turns_per_conversation >= 1):
            raise ValueError(f"turns_per_conversation must be an integer of at least 1, got {turns_per_conversation!r}")
        self.client = client
        self.think_time_s = float(think_time_s)
        self.turns_per_conversation = turns_per_conversation
        # Two locks: user threads take `_state` to count, so stop() must not hold it while it joins
        # them; `_control` serialises start/stop against each other.
        self._control = threading.Lock()
        self._state = threading.Lock()
        self._generation = 0
        self._run: _Run | None = None

    # ---- control ------------------------------------------------------------------------
    def start(self, users: int, system_prompt: str = LOAD_SYSTEM_PROMPT, max_tokens: int = 48) -> None:
        """Start `users` synthetic users (stopping the current ones first, if any)."""
        if not (isinstance(users, int) and not isinstance(users, bool) and 1 <= users <= MAX_USERS):
            raise ValueError(f"users must be an integer between 1 and {MAX_USERS}, got {users!r}")
        if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
                and 1 <= max_tokens <= MAX_TOKENS_LIMIT):
            raise ValueError(f"max_tokens must be an integer between 1 and {MAX_TOKENS_LIMIT}, got {max_tokens!r}")
        if not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
        with self._control:
            self._stop_locked(timeout=30.0)
            self._generation += 1
            run = _Run(self._generation, users)
            for user in range(users):
                thread = threading.Thread(target=self._user, args=(run, user, system_prompt, max_tokens),
                                          name=f"load{run.generation}-u{user}", daemon=True)
                run.threads.append(thread)
            with self._state:
                self._run = run
            for thread in run.threads:
                thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every user and abort its request; returns once none of them is left in the
        engine. Raises TimeoutError if some user thread did not end within `timeout` seconds."""
        with self._control:
            self._stop_locked(timeout)

    def _stop_locked(self, timeout: float) -> None:
        run = self._run
        if run is None:
            return
        # Also on a second call: a user that outlived an earlier timeout is waited for again.
        run.stop.set()
        with self._state:
            in_flight = list(run.in_flight.values())
        # A request still queued in the engine produces no delta for a while: the abort ends
        # its stream at once rather than when it is finally scheduled.
        for request_id in in_flight:
            self.client.abort(request_id)
        deadline = time.monotonic() + timeout
        for thread in run.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = sum(thread.is_alive() for thread in run.threads)
        if alive:
            raise TimeoutError(f"{alive} of {run.users} load users did not stop within {timeout} s")

    @property
    def running(self) -> bool:
        with self._state:
            return self._run is not None and not self._run.stop.is_set()

    def status(self) -> LoadStatus:
        with self._state:
            run = self._run
            if run is None:
                return LoadStatus(running=False, users=0, replies=0, refused=0, errors=0, last_error=None)
            return LoadStatus(running=not run.stop.is_set(), users=run.users, replies=run.replies,
                              refused=run.refused, errors=run.errors, last_error=run.last_error)

    # ---- one user -----------------------------------------------------------------------
    def _user(self, run: _Run, user: int, system_prompt: str, max_tokens: int) -> None:
        rng = random.Random(user)
        conversation = 0
        while not run.stop.is_set():
            try:
                self._conversation(run, user, conversation, system_prompt, max_tokens, rng)
            except Exception as error:  # a user must survive anything, and say what went wrong
                log.exception("load user %d failed", user)
                self._count(run, "errors", f"{type(error).__name__}: {error}"[:200])
                run.stop.wait(_RETRY_WAIT_S)
            conversation += 1

    def _conversation(self, run: _Run, user: int, conversation: int, system_prompt: str, max_tokens: int,
                      rng: random.Random) -> None:
        """One conversation of up to `turns_per_conversation` turns; returns early when a turn is
        refused (the next conversation starts fresh) or cut short."""
        messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for turn in range(self.turns_per_conversation):
            if run.stop.is_set():
                return
            question = QUESTIONS[(user * 7 + conversation * 3 + turn) % len(QUESTIONS)]
            messages.append({"role": "user", "content": question})
            request_id = f"load{run.generation}-u{user}-c{conversation}/t{turn}"
            params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                                    seed=(user * 100_003 + conversation) * 1_009 + turn)
            with self._state:
                run.in_flight[user] = request_id
            try:
                try:
                    stream = self.client.submit(messages, params, request_id=request_id)
                except ValueError as error:
                    self._count(run, "refused", None)
                    log.debug("load request %s refused: %s", request_id, error)
                    if turn == 0:  # even a fresh conversation does not fit: retrying at once would spin
                        run.stop.wait(_RETRY_WAIT_S)
                    return
                # stop() may have read the in-flight ids before this request reached the engine.
                if run.stop.is_set():
                    self.client.abort(request_id)
                # Read to the very end, even when stopping: the stream ends only after the engine
                # has dropped the request, so stop() returning means none is left behind.
                reply, finish_reason, error_text = [], None, None
                for delta in stream:
                    reply.append(delta.text)
                    if delta.finish_reason is not None:
                        finish_reason, error_text = delta.finish_reason, delta.error
            finally:
                with self._state:
                    run.in_flight.pop(user, None)
            if finish_reason == "error":
                self._count(run, "errors", f"{request_id}: {error_text or 'engine error'}"[:200])
                run.stop.wait(_RETRY_WAIT_S)  # a failing engine fails the next request as fast
                return
            if finish_reason not in ("stop", "length"):
                return  # aborted: by stop(), or by someone else; either way this conversation is over
            self._count(run, "replies", None)
            messages.append({"role": "assistant", "content": "".join(reply)})
            if self.think_time_s > 0:
                run.stop.wait(rng.uniform(0.0, self.think_time_s))

    def _count(self, run: _Run, counter: str, error: str | None) -> None:
        with self._state:
            setattr(run, counter, getattr(run, counter) + 1)
            if error is not None:
                run.last_error = error
