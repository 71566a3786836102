"""The chat page's redraws: at most one per interval, every character in order, the first and
the last at once, and text that arrived never waits for a slow next token."""
import asyncio

import pytest

from engine import Delta, Usage
from ui.stream import ReplyStream, paced

USAGE = Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=4, ttft_s=0.1, duration_s=0.5)


class Source:
    """A reply's deltas as a test hands them out; `closed` once the page let go of it."""

    def __init__(self, pieces: list[str], gate_before: int | None = None) -> None:
        self.pieces = pieces
        self.gate_before = gate_before  # the delta that waits for `gate`
        self.gate = asyncio.Event()
        self.closed = False

    async def _deltas(self):
        try:
            for i, text in enumerate(self.pieces):
                if i == self.gate_before:
                    await self.gate.wait()
                last = i == len(self.pieces) - 1
                yield Delta("r", 0, text, (i,), finish_reason="length" if last else None,
                            usage=USAGE if last else None)
        finally:
            self.closed = True

    def stream(self) -> ReplyStream:
        deltas = self._deltas()

        class Closable:
            def __aiter__(self):
                return deltas

            async def aclose(self):
                await deltas.aclose()

        return ReplyStream(Closable())


def test_deltas_within_the_interval_join_the_next_state_every_character_in_order():
    async def main():
        source = Source(["Hel", "lo", ", wor", "ld", "!"])
        reply = source.stream()
        shown = [state.text async for state in paced(reply, interval_s=3600)]
        return shown, reply

    shown, reply = asyncio.run(main())
    assert shown == ["Hel", "Hello, world!"]  # the first at once, the rest with the last
    assert reply.finish_reason == "length" and reply.num_tokens == 5


def test_with_no_interval_every_delta_is_a_state():
    async def main():
        return [state.text async for state in paced(Source(["a", "b", "c"]).stream(), interval_s=0)]

    assert asyncio.run(main()) == ["a", "ab", "abc"]


def test_text_waiting_for_a_slow_next_token_is_shown_when_the_interval_passes():
    async def main():
        source = Source(["one ", "two ", "three"], gate_before=2)
        states = paced(source.stream(), interval_s=0.05)
        first = (await anext(states)).text
        # "two " came within the interval, and "three" waits for the gate: "two " must not.
        second = (await asyncio.wait_for(anext(states), timeout=60)).text
        source.gate.set()
        rest = [state.text async for state in states]
        return first, second, rest

    assert asyncio.run(main()) == ("one ", "one two ", ["one two three"])


def test_closing_the_states_mid_reply_lets_go_of_the_reply():
    async def main():
        source = Source(["a", "b", "c"], gate_before=1)
        states = paced(source.stream(), interval_s=0)
        assert (await anext(states)).text == "a"
        waiting = asyncio.ensure_future(anext(states))  # blocked on the gate
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await states.aclose()
        return source.closed

    assert asyncio.run(main())
