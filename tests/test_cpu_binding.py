"""The engine core's compute threads, each bound to a core of its own (engine/worker/cpu_binding.py):
the CPU list read as the setting gives it, one CPU per physical core first, the cases where
nothing is bound, and a real core process whose OpenMP threads hold distinct CPUs while the
thread that loads its compiled steps may run on any."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from engine import SamplingParams
from engine.runtime.process_client import CoreProcessClient
from engine.worker import cpu_binding


def test_a_cpu_list_reads_as_ranges_and_single_cpus():
    assert cpu_binding.parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert cpu_binding.parse_cpu_list("2, 0,2") == [2, 0]


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "0;1", "-2"])
def test_a_malformed_cpu_list_is_refused_naming_the_setting(text):
    with pytest.raises(ValueError, match=cpu_binding.SETTING):
        cpu_binding.parse_cpu_list(text)


def fake_sysfs(root: Path, cores: dict[int, int]) -> Path:
    for cpu, core in cores.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_threads_take_one_cpu_of_each_physical_core_before_any_sibling(tmp_path):
    # Siblings numbered apart (0/2, 1/3) and next to each other (0/1, 2/3): one per core first.
    assert cpu_binding.cores_first({0, 1, 2, 3}, fake_sysfs(tmp_path / "a", {0: 0, 1: 1, 2: 0, 3: 1})) == [0, 1, 2, 3]
    assert cpu_binding.cores_first({0, 1, 2, 3}, fake_sysfs(tmp_path / "b", {0: 0, 1: 0, 2: 1, 3: 1})) == [0, 2, 1, 3]
    assert cpu_binding.cores_first({5, 7}, tmp_path / "none") == [5, 7]  # no topology: each CPU a core


@pytest.fixture
def clean_binding(monkeypatch):
    for name in (cpu_binding.SETTING, *cpu_binding.USER_BINDINGS):
        monkeypatch.setenv(name, "")  # so that what the binding writes is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(cpu_binding, "_bound", False)
    monkeypatch.setattr(cpu_binding, "_process_cpus", None)
    return monkeypatch


def test_auto_binds_as_many_threads_as_asked_to_distinct_cpus(clean_binding):
    allowed = os.sched_getaffinity(0)
    cpus, threads, line = cpu_binding.bind_compute_threads("cpu", 1, {})
    assert threads == 1 and len(cpus) == 1 and set(cpus) <= allowed
    assert os.environ["GOMP_CPU_AFFINITY"] == str(cpus[0]) and "bound to CPUs" in line
    assert "GOMP_CPU_AFFINITY" not in cpu_binding.unbound_environ()  # a build it starts binds nothing


def test_nothing_is_bound_when_turned_off_on_a_gpu_or_where_the_user_binds(clean_binding):
    for environ, device, why in (({cpu_binding.SETTING: "off"}, "cpu", "=off"), ({}, "cuda:0", "GPU"),
                                 ({"OMP_PROC_BIND": "close"}, "cpu", "OMP_PROC_BIND")):
        cpus, threads, line = cpu_binding.bind_compute_threads(device, 3, environ)
        assert cpus is None and threads == 3 and why in line
    assert "GOMP_CPU_AFFINITY" not in os.environ


def test_a_cpu_list_outside_what_the_process_may_use_is_refused(clean_binding):
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"CPUs \\[{beyond}\\] are not among"):
        cpu_binding.bind_compute_threads("cpu", None, {cpu_binding.SETTING: f"0,{beyond}"})


def cpus_of_threads(pid: int) -> dict[int, str]:
    allowed = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        allowed[int(task.name)] = status.split("Cpus_allowed_list:")[1].split()[0]
    return allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding two threads apart needs two CPUs")
def test_a_core_process_runs_its_two_compute_threads_on_cpus_of_their_own(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(cpu_binding.SETTING, raising=False)
    client = CoreProcessClient(tiny_model_dir, num_gpu_blocks=64, num_cpu_blocks=16, num_threads=2)
    try:
        reply = list(client.submit("Tell me about tides.", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        assert reply[-1].finish_reason == "length"
        pid = client.core_pid
        first, second = cpu_binding.cores_first(os.sched_getaffinity(0))[:2]
        threads = cpus_of_threads(pid)
        assert threads[pid] == str(first)  # the loop's thread: OpenMP's first
        assert str(second) in threads.values()  # its one worker
    finally:
        client.close()


def test_a_thread_that_is_not_computing_gets_every_cpu_back(clean_binding):
    allowed = os.sched_getaffinity(0)
    clean_binding.setattr(cpu_binding, "_process_cpus", allowed)
    seen = []

    def background() -> None:  # started from a bound thread, as the core's loader is
        os.sched_setaffinity(0, {min(allowed)})
        cpu_binding.release_this_thread()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == [allowed]
