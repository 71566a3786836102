"""Which CPUs the engine core's compute threads run on: each OpenMP thread bound to a core of its
own, as vLLM's CPU worker binds its threads (`VLLM_CPU_OMP_THREADS_BIND`).

Why: a step is a run of parallel regions, each ending at a barrier where every thread waits,
spinning, for the slowest. Unbound, the kernel may put two of them on one core while another
process holds the other: then every barrier waits for a time slice, and on a 2-core host beside
one busy process a 44-ms batch step took 0.4-7 s. Bound one to a core, that process takes half
of one thread's core and the step ~3x its time: slower, not stalled. The server's own frontend,
the HTTP clients and any background build share the cores the same way.

$PAGEDCHAT_CPU_OMP_THREADS_BIND: `auto` (the default: one logical CPU on each of the first N
physical cores this process may run on, N the compute threads), `off`, or a CPU list such as
`0-3` or `0,2,4` (its length is then the number of threads). Binding is left to the user where
GOMP_CPU_AFFINITY, OMP_PROC_BIND or OMP_PLACES is set. This module imports no torch: the binding
must be in the environment before the OpenMP runtime loads (it reads it once, at load, and binds
the loading thread to the first CPU: threads started from it later inherit that one CPU, so a
thread that is not a compute thread calls `release_this_thread`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SETTING = "PAGEDCHAT_CPU_OMP_THREADS_BIND"
USER_BINDINGS = ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")
SYSFS = Path("/sys/devices/system/cpu")

_process_cpus: set[int] | None = None  # what the process might run on before the binding
_bound = False  # whether GOMP_CPU_AFFINITY is ours


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6] (ValueError saying what is wrong)."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{SETTING}={text!r}: expected auto, off or a CPU list such as 0-3 or 0,2,4")
        span = range(int(first), int(last if dash else first) + 1)
        if not span:
            raise ValueError(f"{SETTING}={text!r}: the range {part} is empty")
        cpus += [cpu for cpu in span if cpu not in cpus]
    return cpus


def cores_first(allowed: set[int], sysfs: Path = SYSFS) -> list[int]:
    """The allowed CPUs, one per physical core first (the lowest of its siblings), then the rest:
    N threads on the first N spread over N cores where there are that many."""
    firsts: dict[tuple[str, str], int] = {}
    for cpu in sorted(allowed):
        firsts.setdefault(_core_of(cpu, sysfs), cpu)
    first = sorted(firsts.values())
    return first + sorted(allowed - set(first))


def _core_of(cpu: int, sysfs: Path) -> tuple[str, str]:
    topology = sysfs / f"cpu{cpu}" / "topology"
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:  # no topology: each CPU a core of its own
        return ("cpu", str(cpu))


def bind_compute_threads(device: str | None, num_threads: int | None,
                         environ: Mapping[str, str] = os.environ) -> tuple[list[int] | None, int | None, str]:
    """Before the OpenMP runtime loads (before `import torch`), in the engine core's process:
    put the binding in the environment. Returns (the CPUs bound, in thread order, or None; the
    number of compute threads to set, or None for torch's default; a line for the log)."""
    global _process_cpus, _bound
    _process_cpus = os.sched_getaffinity(0)
    setting = environ.get(SETTING, "auto").strip().lower() or "auto"
    if setting == "off":
        return None, num_threads, f"compute threads not bound ({SETTING}=off)"
    if device and device.startswith("cuda"):
        return None, num_threads, "compute threads not bound (the model runs on a GPU)"
    users = [name for name in USER_BINDINGS if environ.get(name)]
    if users:
        return None, num_threads, f"compute threads bound as {', '.join(users)} say"
    if setting == "auto":
        ordered = cores_first(_process_cpus)
        threads = num_threads or len({_core_of(cpu, SYSFS) for cpu in _process_cpus})
        cpus = ordered[:threads]
        if len(cpus) < threads:  # more threads than CPUs: binding would stack them, as not binding does
            return None, num_threads, f"compute threads not bound ({threads} threads, {len(cpus)} CPUs)"
    else:
        cpus = parse_cpu_list(setting)
        outside = sorted(set(cpus) - _process_cpus)
        if outside:
            raise ValueError(f"{SETTING}={setting!r}: CPUs {outside} are not among those this process may use "
                             f"({','.join(map(str, sorted(_process_cpus)))})")
        threads = len(cpus)
    os.environ["GOMP_CPU_AFFINITY"] = " ".join(map(str, cpus))
    _bound = True
    return cpus, threads, f"{threads} compute threads bound to CPUs {','.join(map(str, cpus))} ({SETTING}={setting})"


def release_this_thread() -> None:
    """Let the calling thread (and what it starts) run on every CPU the process could before the
    binding: for a thread that is not a compute thread (a background load or build)."""
    if _process_cpus is not None:
        os.sched_setaffinity(0, _process_cpus)


def unbound_environ(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` without the binding this module put there: for a process the core starts that
    is not the core (a build binds nothing of its own)."""
    return {key: value for key, value in environ.items() if not (_bound and key == "GOMP_CPU_AFFINITY")}
