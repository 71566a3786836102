"""Which processes are alive, read from /proc (Linux): a process group's members, processes whose
command line names something, and waiting on a condition with a deadline. A zombie (exited, not
yet reaped by whoever adopted it) counts as gone."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from waiting import poll


def _processes() -> list[tuple[int, int, str]]:
    """(pid, process group, command line) of every live process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended while we looked
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if state not in ("Z", "X"):
            found.append((int(entry.name), int(pgrp), cmdline))
    return found


def alive(pid: int) -> bool:
    return any(p == pid for p, _, _ in _processes())


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    return [pid for pid, pgrp, _ in _processes() if pgrp == pgid]


def processes_naming(*words: str) -> list[int]:
    """Live processes whose command line holds every one of `words`."""
    return [pid for pid, _, cmdline in _processes() if all(word in cmdline for word in words)]


def wait_until(condition: Callable[[], object], timeout: float = 60.0, interval: float = 0.2) -> bool:
    """Poll `condition` until it is true (True) or `timeout` seconds pass (False); tests/waiting.py's
    `poll`, for callers that assert on the answer themselves."""
    return bool(poll(condition, timeout, interval))
