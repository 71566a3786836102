"""Timestamps: ISO 8601 in UTC, strictly increasing within the process.

Strictly increasing so that "newest first" is never a tie, even for two writes in the same
microsecond; ISO strings so that the database stays readable and sorts as text.
"""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

_lock = threading.Lock()
_last = datetime.min.replace(tzinfo=timezone.utc)


def now() -> str:
    global _last
    with _lock:
        moment = max(datetime.now(timezone.utc), _last + timedelta(microseconds=1))
        _last = moment
    return moment.isoformat(timespec="microseconds")
