"""One measurement in a fresh Python process: memory figures that start from nothing a previous
case left behind (allocator pools, mapped files, imported modules). The function runs in the
child, and its result comes back as the JSON line it prints last."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_fresh(module: str, function: str, *args, timeout_s: float = 7200, what: str = "") -> dict:
    """`module.function(*args)` in a new interpreter (arguments as Python literals), its result."""
    call = f"{function}({', '.join(repr(arg) for arg in args)})"
    code = (f"import json, sys; sys.path[0] = {str(ROOT)!r}; from {module} import {function}; "
            f"print(json.dumps({call}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"{what or call}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
