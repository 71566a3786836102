"""Builds of compiled steps, each a process of its own (`python -m engine.worker.compiled`) at a low
priority, supervised by the engine that started it. A build runs in a process group of its own,
with a scratch folder its engine chose beside the packages: a timeout or the engine's exit ends the
whole group (the compiler's workers too) and removes what it left, and a build whose engine was
killed ends itself; the next engine removes what that one left."""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.worker import cpu_binding
from engine.worker.compiled.package_key import staging_path

log = logging.getLogger(__name__)

# One package's build that takes longer is stopped (SmolLM2's lone and flat packages together
# take ~2.5 min on a 2-core Zen 5, 7-11 min in fp32 on a busy 2-core Zen 1 EPYC).
BUILD_TIMEOUT_S = 30 * 60


@dataclass(eq=False)
class _Build:
    """A build subprocess, the leader of its own process group, and what it may leave behind."""
    process: subprocess.Popen
    scratch: Path  # inductor's cache for this build (hundreds of MB), chosen by the engine
    staging: Path  # the half-written package

    def end(self) -> None:
        """Kill the whole group (the compiler's workers with the build) and remove what it left."""
        if self.process.returncode is None:  # not reaped yet: the group's id is still its own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        self.clean()

    def clean(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.staging.unlink(missing_ok=True)


_builds: set[_Build] = set()  # running now, ended when this process exits


_builds_lock = threading.Lock()  # held while a build starts: none starts once exiting is set


_exiting = threading.Event()


@atexit.register
def _end_builds() -> None:
    """A build outliving its engine (a one-off script, a server shut down) would compile on, orphaned."""
    with _builds_lock:
        _exiting.set()
        running = list(_builds)
    for build in running:
        build.end()


# What a build leaves in the packages folder while it runs: the scratch folder its engine made
# (named for the engine's pid) and its half-written package and digest (named for its own).
_LEFTOVER = re.compile(r"^\.scratch-(\d+)-|\.(\d+)\.tmp(\.pt2)?$")


def sweep_leftovers(folder: Path) -> None:
    """Remove what builds left whose processes are gone (an engine killed before it could)."""
    for entry in folder.iterdir():
        match = _LEFTOVER.search(entry.name)
        if match and not _alive(int(match.group(1) or match.group(2))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return True
    return True


def end_group() -> None:
    """Kill this build's process group (the compiler's workers are in it), when it has one."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)


def lower_priority() -> None:
    """A build beside a serving engine takes what CPU the engine leaves. Its nice value alone
    does not do that where the kernel groups processes by session (autogroups: Debian's and
    Ubuntu's default): a build in a session of its own is scheduled as a group beside the engine's,
    whatever its nice value, and took a whole core from the engine's two. So the group's nice
    value is raised too."""
    os.nice(10)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")


def build_in_subprocess(model: str | None, dtype: torch.dtype, kind: str, path: Path) -> None:
    """Build the `kind` package for `model` in `dtype` into `path` in a supervised process of its
    own; raises RuntimeError when it fails, times out or this process is exiting."""
    log.info("building the compiled %s step (once per machine): %s", kind, path.name)
    root = Path(__file__).resolve().parents[3]
    with _builds_lock:
        if _exiting.is_set():
            raise RuntimeError("not building: this process is exiting")
        scratch = Path(tempfile.mkdtemp(prefix=f".scratch-{os.getpid()}-", dir=path.parent))
        command = [sys.executable, "-m", "engine.worker.compiled", "--background", "--dtype",
                   str(dtype).removeprefix("torch."), "--kind", kind, "--out", str(path),
                   "--scratch", str(scratch), "--parent", str(os.getpid())]
        if model:
            command += ["--model", model]
        try:
            process = subprocess.Popen(command, env={**cpu_binding.unbound_environ(), "PYTHONPATH": str(root)}, cwd=root,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        build = _Build(process, scratch, staging_path(path, process.pid))
        _builds.add(build)
    try:
        _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the build took over {BUILD_TIMEOUT_S} s and was stopped") from None
    finally:
        build.end()
        with _builds_lock:
            _builds.discard(build)
    if process.returncode != 0:
        raise RuntimeError(f"the build exited with {process.returncode}: {stderr.strip()[-2000:]}")
