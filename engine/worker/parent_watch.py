"""A helper process that ends when the process that started it is gone.

A process the engine starts for work of its own (a compiled step's build, the API's tokenizer
worker) waits for that work or for more of it; if the engine is killed, nothing tells it to stop,
and it would compute or wait on, orphaned. A thread of the helper watches the engine instead.
"""
from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable


def end_with_parent(parent: int, before_exit: Callable[[], None] | None = None) -> None:
    """In the helper: exit (after `before_exit`) once process `parent` has exited."""
    def watch() -> None:
        try:
            handle = os.pidfd_open(parent)
        except (AttributeError, OSError):  # no pidfds here, or the parent is gone already
            handle = None
        if handle is not None and os.getppid() == parent:
            select.select([handle], [], [])  # readable once it has exited
        while os.getppid() == parent:
            time.sleep(1.0)
        if before_exit is not None:
            before_exit()
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()
