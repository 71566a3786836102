"""`python SCRIPT ARGS` for the benchmark scripts' tests, forked from one interpreter that has
already imported torch, numpy and transformers' Llama, tokenizer and generation modules: a fresh
start spends ~7 s of CPU on those imports (2-core Zen 1), and most scripts these tests run make
them.

The fork runs the script as the command line does: as `__main__`, with sys.argv, sys.path[0] the
script's folder, the caller's working directory, stdin from /dev/null, stdout and stderr
captured, exit status from SystemExit (an uncaught exception: 1, its traceback on stderr), then
the interpreter's shutdown (non-daemon threads joined, atexit handlers run). Nothing of this
repository is preloaded, so each script's own import set-up (benchmarks/kernels.py shadows the
`kernels` package) is still exercised. A fresh `python` runs the script instead when the
environment has changed since the preloaded interpreter started (torch and transformers read it
as they import), and on a machine with a GPU (CUDA must not meet a fork).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOAD = ("numpy", "torch", "safetensors", "tokenizers", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.auto.tokenization_auto", "transformers.generation.utils")


# Set by pytest for each test, read by nothing at import: a change of it needs no fresh interpreter.
PER_TEST = ("PYTEST_CURRENT_TEST",)


def _import_time_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in PER_TEST}


class _Preloaded:
    """The preloaded interpreter: requests as JSON lines on its stdin, answers on its stdout."""

    def __init__(self) -> None:
        self.env = _import_time_env()
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=self.env)
        self.lock = threading.Lock()
        self._unread = b""  # the answers are read from the descriptor: select() sees no buffer

    def run(self, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="preloaded-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"args": [str(a) for a in args], "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
                       "env": dict(os.environ)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = int(self._answer(None, "pid"))
            try:
                status = int(self._answer(timeout, "exit"))
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                self._answer(None, "exit")
                raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(args, status, out.read_text(), err.read_text())

    def _answer(self, timeout: float | None, kind: str) -> str:
        fd = self.process.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._unread:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(kind, timeout)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the preloaded interpreter ended (exit {self.process.wait()})")
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        if not line.startswith(kind.encode() + b" "):
            raise RuntimeError(f"the preloaded interpreter answered {line!r}")
        return line.decode().split(" ", 1)[1]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


_preloaded: _Preloaded | None = None


def run_python(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`[sys.executable, *args]` in `cwd`, stdout and stderr captured as text, as subprocess.run
    would run it (raising TimeoutExpired after killing it); `args[0]` is the script."""
    global _preloaded
    if os.path.exists("/dev/nvidia0") or (_preloaded is not None and _preloaded.env != _import_time_env()):
        return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if _preloaded is None or _preloaded.process.poll() is not None:
        _preloaded = _Preloaded()
        atexit.register(_preloaded.close)
    return _preloaded.run(args, cwd, timeout)


# ---- the preloaded interpreter ------------------------------------------------------------------

def _serve() -> None:
    import importlib

    # The answers get a descriptor of their own: nothing the imports print can garble them.
    requests, answers = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for name in PRELOAD:
        importlib.import_module(name)
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            _child(request)
        answers.write(f"pid {pid}\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
        answers.flush()


def _child(request: dict) -> None:
    import runpy
    import traceback

    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin = open(0, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = os.path.abspath(request["args"][0])
        sys.argv = [request["args"][0], *request["args"][1:]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:
            if exit.code is None or isinstance(exit.code, int):
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
            traceback.print_exc()
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve()
