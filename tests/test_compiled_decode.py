"""The compiled steps (engine/worker/compiled/): built in the background while the
eager path serves, then the same greedy tokens as the eager path: a lone chat's through buffer
growth, batch-to-lone hand-overs and moved blocks, the flat step's batches with and without a shared
prefix and its prompt chunks beside decodes;
the real model's weights and shapes (a slice of its layers) against transformers. Only a
package this user's own build wrote, in a folder nobody else can write to, is ever loaded; a
build runs in a process group of its own that ends with it, on a timeout or with the engine's
process."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.sampling_params import StructuredOutputsParams
from engine.worker import package_trust
from engine.worker.compiled import builds, export, steps
from engine.worker.compiled.package_key import package_path
from engine.worker.compiled.shapes import CAPACITY_STEP, KINDS
from engine.worker.compiled.lone_step import plain_matrix
from engine.worker.compiled.steps import CompiledSteps
from engine.worker.models.layers.matvec import MatVec
from hf_reference import hf_greedy
from processes import alive, group_members, processes_naming, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)
PYTHON = sys.executable  # the real one: some tests replace sys.executable with a stand-in
BUILD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Compiled packages go to a folder of this module's own (not the machine's cache)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDCHAT_COMPILED_DIR", str(tmp_path_factory.mktemp("compiled")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def smol_slice(smol_hf, tmp_path_factory):
    """The default model's first two layers with its own weights, embedding, final norm and
    tokenizer, saved as a model folder, and the same slice as a transformers model: the real
    model's shapes (9 query heads over 3 K/V heads, head_dim 64, hidden 576, a 49,152-token
    tied head) and weights, in packages built in a fraction of the whole model's time (the
    graph is unrolled layer by layer: ~100 s for both here against ~430 s for 30 layers)."""
    import copy

    from engine.worker.loading.model_loader import load_tokenizer

    hf = copy.deepcopy(smol_hf)
    hf.model.layers = hf.model.layers[:2]
    hf.config.num_hidden_layers = 2
    if hasattr(hf.config, "layer_types"):
        hf.config.layer_types = hf.config.layer_types[:2]
    folder = tmp_path_factory.mktemp("smol-slice")
    hf.save_pretrained(folder)
    load_tokenizer(None).save_pretrained(folder)
    return str(folder), hf.eval()


@pytest.fixture(scope="module")
def slice_dir(smol_slice) -> str:
    return smol_slice[0]


_preparing: list[CompiledSteps] = []  # compiled steps this module's engines build or load in the background


@pytest.fixture(scope="module")
def slice_building(packages, slice_dir):
    """An fp32 engine on the default model's two-layer slice, asked for compiled steps: what it
    served eagerly while it began to build them in the background. The builds (one after the
    other, each on one core) go on while the tests that need neither the steps nor anything
    else of them run; the first test that needs the steps waits for them."""
    assert not package_path(slice_dir, torch.float32).exists()
    llm = LLM(slice_dir, dtype="float32", num_gpu_blocks=64, num_cpu_blocks=8, compile_decode=True)
    compiled = llm.engine.compiled
    _preparing.append(compiled)
    served = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids
    not_ready_while_serving = not compiled.ready
    return llm, served, not_ready_while_serving


@pytest.fixture(scope="module")
def slice_compiled(slice_building):
    """The fp32 engine on the slice once the compiled steps it built itself are ready."""
    compiled = slice_building[0].engine.compiled
    assert compiled.wait(BUILD_TIMEOUT_S), compiled.error
    return slice_building


def settle_builds() -> None:
    """Before a test replaces what a build or a load reads (sys.executable, the packages folder,
    the build timeout, the package loader): this module's background builds have ended."""
    for compiled in _preparing:
        compiled.wait(BUILD_TIMEOUT_S)


@pytest.fixture
def builds_settled() -> None:
    settle_builds()


def count_calls(monkeypatch, compiled: CompiledSteps, method: str = "decode") -> list:
    calls = []
    decode = getattr(compiled, method)

    def spy(tokens, *args):
        calls.append(tokens)
        return decode(tokens, *args)

    monkeypatch.setattr(compiled, method, spy)
    return calls


# ---- stand-in builds, for which packages load and how a build ends ---------------------------
# These never compile: the interpreter that runs `python -m engine.worker.compiled` is
# replaced by a stand-in that takes the same arguments and fails, writes a package the way a build
# installs one, or hangs with a worker process of its own, as the compiler's workers do.
FAKE_BUILD = textwrap.dedent('''
    import argparse, os, subprocess, sys, time
    from pathlib import Path

    parser = argparse.ArgumentParser()
    for name in ("--out", "--kind", "--scratch", "--dtype", "--model", "--parent"):
        parser.add_argument(name)
    args, _ = parser.parse_known_args()
    out = Path(args.out)
    with open(os.environ["FAKE_BUILD_LOG"], "a") as log:
        log.write(args.kind + "\\n")
    mode = os.environ["FAKE_BUILD_MODE"]
    staging = out.with_name(f"{out.stem}.{os.getpid()}.tmp.pt2")
    out.parent.mkdir(parents=True, exist_ok=True)
    if mode == "fail":
        sys.exit("fake build: no compiler here")
    if mode == "rebuild":
        from engine.worker.package_trust import install
        staging.write_bytes(b"rebuilt " + args.kind.encode())
        install(staging, out)
        sys.exit(0)
    if args.scratch:  # "hang": scratch files, half a package, a worker, and no end
        (Path(args.scratch) / "inductor-cache").write_bytes(bytes(1000))
    staging.write_bytes(b"half a package")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids = Path(os.environ["FAKE_BUILD_PIDS"]) / args.kind
    pids.with_suffix(".tmp").write_text(f"{os.getpid()} {os.getpgrp()} {worker.pid} {args.scratch}")
    pids.with_suffix(".tmp").replace(pids)
    time.sleep(600)
''')


class FakeBuilds:
    """Stand-in builds under `root`: a packages folder of their own, whose builds run FAKE_BUILD in
    `mode` ("fail" unless set), for this process (`use_here`) or a process started with `env`.
    `.starts()` lists the kinds a build was started for, `.pids(kind)` what a hanging one left
    (its pid, its process group, its worker's pid, its scratch folder)."""

    def __init__(self, root: Path) -> None:
        script, self.python = root / "fake_build.py", root / "fake_python"
        script.write_text(FAKE_BUILD)
        self.python.write_text(f'#!/bin/sh\nexec "{PYTHON}" "{script}" "$@"\n')
        self.python.chmod(0o755)
        self.folder, self.log, self.pids_dir = root / "compiled", root / "builds.log", root / "pids"
        self.pids_dir.mkdir()
        self.env = {"PAGEDCHAT_COMPILED_DIR": str(self.folder), "FAKE_BUILD_LOG": str(self.log),
                    "FAKE_BUILD_PIDS": str(self.pids_dir), "FAKE_BUILD_MODE": "fail"}
        self._here: pytest.MonkeyPatch | None = None

    def use_here(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """This process's builds are these stand-ins (only once no build of its own is running)."""
        self._here = monkeypatch
        monkeypatch.setattr(sys, "executable", str(self.python))
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)

    def mode(self, mode: str) -> None:
        self.env["FAKE_BUILD_MODE"] = mode
        if self._here is not None:
            self._here.setenv("FAKE_BUILD_MODE", mode)

    def starts(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def pids(self, kind: str) -> tuple[int, int, int, str]:
        pid, pgrp, worker, scratch = (self.pids_dir / kind).read_text().split()
        return int(pid), int(pgrp), int(worker), scratch

    def end_leftovers(self) -> None:
        """A test that failed may leave a hanging build behind."""
        for kind in KINDS:
            if (self.pids_dir / kind).exists():
                pid, _, worker, _ = self.pids(kind)
                for process in (pid, worker):
                    if alive(process):
                        os.kill(process, signal.SIGKILL)


@pytest.fixture
def fake_kit(tmp_path):
    """Stand-in builds for processes this test starts; this process's own builds are untouched."""
    fake = FakeBuilds(tmp_path)
    yield fake
    fake.end_leftovers()


@pytest.fixture
def fake_builds(builds_settled, fake_kit, monkeypatch):
    """Stand-in builds for this process's engines."""
    fake_kit.use_here(monkeypatch)
    return fake_kit


def spy_loads(monkeypatch) -> list[tuple[Path, bytes]]:
    """Every package the engine is asked to load, with its bytes then: (path, bytes). Nothing is
    loaded (it raises, so the engine goes on eagerly)."""
    seen = []

    def spy(path):
        seen.append((Path(path), Path(path).read_bytes()))
        raise RuntimeError("the test's stand-in loads nothing")

    monkeypatch.setattr(steps, "LoadedPackage", spy)
    return seen


@pytest.fixture
def loads(builds_settled, monkeypatch):
    return spy_loads(monkeypatch)


def plant(folder: Path, model: str, content: bytes, digest_of: bytes | None = None) -> list[Path]:
    """Packages at both kinds' paths, with a digest record of `digest_of` when given."""
    paths = [package_path(model, torch.float32, kind) for kind in KINDS]
    for path in paths:
        assert path.parent == folder
        path.write_bytes(content)
        if digest_of is not None:
            path.with_name(path.name + ".sha256").write_text(sha256_record(digest_of, path.name))
    return paths


def serve_eagerly(model: str) -> LLM:
    """An engine asked for compiled steps that answers (eagerly) while they are prepared, and
    whose preparing has settled without a step becoming ready."""
    llm = LLM(model, dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    output = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0]
    assert len(output.token_ids) == 4 and output.finish_reason == "length"
    assert not llm.engine.compiled.wait(120)
    assert llm.engine.compiled.settled and not llm.engine.compiled.ready and not llm.engine.compiled.flat_ready
    return llm


def sha256_record(data: bytes, name: str) -> str:
    """A digest file's text, as `sha256sum` writes it."""
    return f"{hashlib.sha256(data).hexdigest()}  {name}\n"


DRIVER = textwrap.dedent('''
    import os
    import sys
    from engine import LLM, SamplingParams
    from processes import wait_until

    model, python, started = sys.argv[1:4]
    if python != "-":
        sys.executable = python
    llm = LLM(model, dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
    if started != "-":
        assert wait_until(lambda: os.path.exists(started), 120), "no build started"
    if sys.argv[4] == "stay":
        sys.stdin.read()  # until the test kills us
''')


def run_driver(tmp_path, model: str, env: dict[str, str], python: str, started: Path | None,
               stay: bool) -> subprocess.Popen:
    """An engine process with `env` added to its environment that starts its compiled steps'
    build (run by `python`, "-" for the real one), waits until `started` exists, then exits or
    stays until killed."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, **env, "PYTHONPATH": f"{tests.parent}:{tests}"}
    return subprocess.Popen([PYTHON, str(script), model, python, str(started or "-"), "stay" if stay else "exit"],
                            cwd=tests.parent, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_engine_serves_eagerly_while_the_step_builds(slice_building, slice_dir):
    llm, served, not_ready_while_serving = slice_building
    assert not_ready_while_serving and len(served) == 4
    eager = LLM(slice_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    assert eager.engine.compiled is None
    assert eager.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids == served


# ---- while the slice's steps build: tests that need none of them and replace nothing its -----
# ---- builds and loads read (their subprocesses have a core to themselves meanwhile) ----------


def run_forward_ab(model: str, dtype: str, monkeypatch, chats: int = 1) -> dict:
    """benchmarks/forward_ab.py with the compiled-step variant on one captured step of `model`
    with `chats` chats: its figures for the compiled side (building the step first when there is
    no package). The script runs in this process, which has torch and transformers imported
    already: a fresh interpreter spent ~5 s of a core on them each time."""
    import json
    import runpy

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("MODEL", model)
    monkeypatch.setattr(sys, "argv", [str(root / "benchmarks" / "forward_ab.py"), "--model", model, "--dtype", dtype,
                                      "--chats", str(chats), "--tokens", "14", "--step", "12", "--rounds", "2",
                                      "--repeat", "1", "--variant",
                                      str(root / "benchmarks" / "variants" / "compiled_step.py")])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script points sys.path[0] at the repository
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        pytest.fail(f"forward_ab.py stopped: {stop}")
    figures = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert figures["base_unchanged"]
    return figures["sides"]["compiled"]


def test_bf16_step_matches_eager(packages, tiny_model_dir, monkeypatch):
    """bf16: the compiled lone step (its weight matmuls loops of its own over `MatVec` blocks,
    summed in fp32) gives the eager forward's greedy token and its logits up to bf16 rounding on
    a captured step."""
    compiled = run_forward_ab(tiny_model_dir, "bfloat16", monkeypatch)
    assert package_path(tiny_model_dir, torch.bfloat16, "lone").exists()
    assert not package_path(tiny_model_dir, torch.bfloat16, "flat").exists()  # a lone step's A/B builds no flat step
    # bf16 keeps 8 significant bits: this model's logits (tens) round to steps of 0.125 or 0.25.
    assert compiled["same_greedy"] and compiled["max_abs_diff"] <= 0.5


def test_the_build_records_the_digest_of_what_it_wrote(tiny_model_dir, tmp_path, monkeypatch):
    """`build` (its compiling replaced) installs the package with a record of its sha256 beside it."""
    def compile_and_package(program, package_path, inductor_configs):
        Path(package_path).write_bytes(b"compiled " + str(sorted(inductor_configs)).encode())

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    out = export.build(tiny_model_dir, torch.float32, tmp_path / "decode-tiny.pt2")
    assert out.read_bytes().startswith(b"compiled ")
    assert (tmp_path / "decode-tiny.pt2.sha256").read_text() == sha256_record(out.read_bytes(), out.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-tiny.pt2", "decode-tiny.pt2.sha256"]


def test_packages_are_keyed_by_model_and_dtype(packages, tiny_model_dir, deep_model_dir):
    paths = {package_path(m, d) for m in (tiny_model_dir, deep_model_dir) for d in (torch.float32, torch.bfloat16)}
    assert len(paths) == 4 and all(p.suffix == ".pt2" for p in paths)
    assert package_path(tiny_model_dir, torch.float32) == package_path(tiny_model_dir, torch.float32)


def test_a_hub_models_package_follows_its_revision(packages, tmp_path, monkeypatch):
    """A hub id is keyed by the snapshot the engine loaded (huggingface_hub's cache): a new
    revision of the model is a new package, not the old one's weights."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someone--tiny-chat"
    for revision, width in (("a" * 40, 64), ("b" * 40, 128)):
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "config.json").write_text(f'{{"hidden_size": {width}}}')
    (repo / "refs").mkdir()
    paths = []
    for revision in ("a" * 40, "b" * 40):
        (repo / "refs" / "main").write_text(revision)
        paths.append(package_path("someone/tiny-chat", torch.float32))
    assert paths[0] != paths[1] and all(p.name.startswith("decode-tiny-chat-float32-") for p in paths)


@pytest.mark.parametrize("rows, bias", [(64, False), (70, True), (5, True)])
def test_matvec_blocks_multiply_like_linear(rows, bias):
    """`MatVec` keeps a weight in blocks of one cache line of output features (16 in fp32),
    padding the last block: one row times it is `linear`'s result, whatever the row count."""

    torch.manual_seed(0)
    weight, b = torch.randn(rows, 48), torch.randn(rows) if bias else None
    x = torch.randn(1, 48)
    layer = MatVec(weight, b)
    assert layer.blocks.shape == (-(-rows // 16), 48, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_build_ends_when_the_engine_process_exits(fake_kit, tiny_model_dir, tmp_path):
    fake_kit.mode("hang")
    driver = run_driver(tmp_path, tiny_model_dir, fake_kit.env, str(fake_kit.python), fake_kit.pids_dir / "lone",
                        stay=False)
    _, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, err[-3000:]
    pid, pgrp, worker, scratch = fake_kit.pids("lone")
    assert wait_until(lambda: not alive(pid) and not alive(worker)), "the build outlived the engine's process"
    assert pgrp == pid and wait_until(lambda: not group_members(pgrp))
    assert not Path(scratch).exists() and list(fake_kit.folder.iterdir()) == []


def test_a_build_ends_when_the_engine_process_is_killed(fake_kit, tiny_model_dir, tmp_path, monkeypatch):
    """The real build (`python -m engine.worker.compiled`) watches the process that
    started it: killed, that process can clean nothing up, so the build ends its own group, and
    the next engine to prepare steps in the folder removes the scratch folder it left."""
    folder = fake_kit.folder

    def builds() -> list[int]:
        return processes_naming("engine.worker.compiled", str(folder))

    driver = run_driver(tmp_path, tiny_model_dir, fake_kit.env, "-", None, stay=True)
    try:
        assert wait_until(builds, 300), driver.stderr.read() if driver.poll() is not None else "no build started"
        driver.kill()
        driver.wait(timeout=30)
        assert wait_until(lambda: not builds()), "the build outlived the engine's killed process"
        assert list(folder.iterdir())  # what it left: its scratch folder at least
        # Up to here nothing of this process was replaced: the test runs while the slice's steps
        # build. What follows replaces what its builds and loads read.
        settle_builds()
        fake_kit.use_here(monkeypatch)
        loads = spy_loads(monkeypatch)
        serve_eagerly(tiny_model_dir)  # the stand-in build fails: nothing loads, leftovers are swept
        assert fake_kit.starts() == ["lone", "flat"] and loads == []
        assert list(folder.iterdir()) == []
    finally:
        driver.kill()
        for pid in builds():
            os.kill(pid, signal.SIGKILL)


# ---- the slice's compiled steps ---------------------------------------------------------------


def test_the_engine_built_each_step_with_its_digest_recorded(slice_compiled, slice_dir):
    for kind in KINDS:
        assert package_trust.digest_problem(package_path(slice_dir, torch.float32, kind)) is None


SERVE_BUILT = textwrap.dedent('''
    import json
    import sys
    from engine import LLM, SamplingParams

    llm = LLM(sys.argv[1], dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    compiled = llm.engine.compiled
    assert compiled.all_built() and compiled.wait(120), compiled.error
    ran = set()
    for method in ("decode", "run_flat"):
        step = getattr(compiled, method)
        setattr(compiled, method, lambda *args, step=step, method=method: ran.add(method) or step(*args))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7, 8], [9, 10]], greedy)  # a batch: the flat step
    llm.generate([[5, 6, 7, 8]], greedy)  # a lone chat: its decode step
    compiler = [m for m in sys.modules if m.split(".")[:2] in (["torch", "_inductor"], ["torch", "_dynamo"])]
    print(json.dumps({"ran": sorted(ran), "compiler": compiler}))
''')


def test_serving_built_steps_never_imports_the_compiler(slice_compiled, slice_dir):
    """A process that loads the built packages and serves with them has no use for inductor
    (or dynamo, which it imports): ~140 MiB resident that only a build needs."""
    import json

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{tests.parent}:{tests}"}  # the packages folder of this module's
    done = subprocess.run([PYTHON, "-c", SERVE_BUILT, slice_dir], cwd=tests.parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert served == {"ran": ["decode", "run_flat"], "compiler": []}


def test_lone_chats_decode_the_eager_tokens(slice_compiled, slice_dir, tokenizer, monkeypatch):
    """Greedy fp32: the same tokens as the eager engine, for a chat long enough that its K/V
    buffer grows twice, and for a batch whose longer chat goes on alone (its buffer gathered
    from the paged cache when the other one ends)."""
    llm = slice_compiled[0]
    calls = count_calls(monkeypatch, llm.engine.compiled)
    eager = LLM(slice_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    prompt = tokenizer("In a hole in the ground there lived a hobbit.", add_special_tokens=False).input_ids
    long = SamplingParams(max_tokens=2 * CAPACITY_STEP + 10, **GREEDY)
    ours = llm.generate([prompt], long)[0].outputs[0].token_ids
    assert ours == eager.generate([prompt], long)[0].outputs[0].token_ids
    assert len(calls) == long.max_tokens - 1  # every step after the prompt's

    calls.clear()
    batch = [prompt, tokenizer("Once", add_special_tokens=False).input_ids]
    params = [SamplingParams(max_tokens=40, **GREEDY), SamplingParams(max_tokens=12, **GREEDY)]
    ours = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert ours == [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert len(calls) == 40 - 12  # only the steps the longer chat took alone
    assert llm.engine.compiled._buffer is None  # and nothing is held once idle


def test_decode_batches_decode_the_eager_tokens(slice_compiled, slice_dir, tokenizer, monkeypatch):
    """Greedy fp32: batches of decodes through the compiled flat step give the eager engine's
    tokens, for chats that share a system prompt of whole blocks (read once for all of them),
    chats that share nothing, and chats of different lengths that drop out one by one."""
    llm = slice_compiled[0]
    flat_calls = count_calls(monkeypatch, llm.engine.compiled, "run_flat")
    eager = LLM(slice_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    system = tokenizer("You are a helpful assistant who answers in one short sentence. " * 4,
                       add_special_tokens=False).input_ids
    assert len(system) >= 2 * 16  # two whole blocks every chat shares
    questions = ["Why is the sky blue?", "Name a prime.", "Hello there", "What is a hobbit?"]
    shared = [system + tokenizer(q, add_special_tokens=False).input_ids for q in questions]
    alone = [tokenizer(q, add_special_tokens=False).input_ids for q in questions[:3]]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (30, 9, 21, 14)]
    for prompts in (shared, alone):
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params[:len(prompts)])]
        assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params[:len(prompts)])]
    decode_batches = [seqs for seqs in flat_calls if all(len(s.tokens) == 1 for s in seqs)]
    assert len(decode_batches) >= 2 * 20 and {len(seqs) for seqs in decode_batches} >= {2, 3, 4}


def test_mixed_steps_decode_transformers_greedy_tokens(slice_compiled, smol_slice, monkeypatch):
    """The real model's weights in fp32, through the compiled flat step: chats that arrive while
    others decode (their prompts beside the decodes in one step, one of them past a cached
    system prompt, one chunked by the token budget) each get transformers' greedy tokens."""
    llm, hf = slice_compiled[0], smol_slice[1]
    engine = llm.engine
    flat_calls = count_calls(monkeypatch, engine.compiled, "run_flat")
    chats = ([{"role": "system", "content": "You are a pirate who loves the sea and talks about it all day long."},
              {"role": "user", "content": "Say hello."}],
             [{"role": "system", "content": "You are a pirate who loves the sea and talks about it all day long."},
              {"role": "user", "content": "What is your ship called?"}],
             [{"role": "user", "content": "What is the capital of France? " * 12}])
    prompts = [engine.encode(engine.apply_chat_template(chat)) for chat in chats]
    expected = [hf_greedy(hf, ids, 12) for ids in prompts]
    monkeypatch.setattr(engine.core.scheduler.config, "max_num_batched_tokens", 48)  # chunks the long prompt
    outputs: dict[str, list[int]] = {}
    engine.add_request("c0", prompts[0], SamplingParams(max_tokens=12, **GREEDY))
    added = 1
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        if added < len(prompts) and outputs.get("c0"):  # the others arrive while the first decodes
            engine.add_request(f"c{added}", prompts[added], SamplingParams(max_tokens=12, **GREEDY))
            added += 1
    assert [outputs[f"c{i}"] for i in range(len(prompts))] == expected
    mixed = [seqs for seqs in flat_calls if any(len(s.tokens) == 1 for s in seqs) and any(len(s.tokens) > 1 for s in seqs)]
    assert mixed, "no step ran prompt chunks beside decodes"
    assert any(s.start > 0 for seqs in mixed for s in seqs if len(s.tokens) > 1)  # a chunk past a cached prefix


def test_real_weights_compiled_greedy_equals_transformers(slice_compiled, smol_slice, monkeypatch):
    """The default model's own weights and shapes in fp32 (a two-layer slice of it: the compiled
    steps are the same code for every depth): lone decode steps through the compiled lone-chat
    graph, then the same chats together, their steps through the compiled flat graph, each
    token transformers' greedy token."""
    llm, hf = slice_compiled[0], smol_slice[1]
    calls = count_calls(monkeypatch, llm.engine.compiled)
    flat_calls = count_calls(monkeypatch, llm.engine.compiled, "run_flat")
    chats = ([{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}])
    prompts = [llm.engine.encode(llm.engine.apply_chat_template(chat)) for chat in chats]
    expected = [hf_greedy(hf, ids, 24) for ids in prompts]
    for ids, tokens in zip(prompts, expected):
        assert llm.generate([ids], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].token_ids == tokens
    assert len(calls) == 2 * 23 and all(len(seqs) > 1 or len(seqs[0].tokens) > 1 for seqs in flat_calls)
    flat_calls.clear()
    together = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert [o.outputs[0].token_ids for o in together] == expected
    # 24: all but each prompt's last token came from the cache, so the prompts' step was a batch decode too
    assert [o.num_cached_tokens for o in together] == [len(ids) - 1 for ids in prompts]
    assert len(flat_calls) == 24


def test_once_every_compiled_step_is_in_the_plain_copies_go(slice_compiled):
    """fp32 keeps a matrix plain beside its packed copy where the plain one streams a few rows
    faster (layers/linear.py); once both compiled steps run, a step lets the plain ones go, and
    an eager step of a few rows, should one come, multiplies by the
    packed copy to the same result."""
    llm = slice_compiled[0]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY))  # a step, with both steps in
    model = llm.engine.core.model
    linears = [model.lm_head, *(getattr(layer, name) for layer in model.layers
                                for name in ("qkv", "o_proj", "gate_up", "down"))]
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: the matrices are kept plain only")
    assert all(linear.weight is None and linear.packed is not None for linear in linears)
    down = model.layers[0].down
    x = torch.randn(2, down.in_features)
    torch.testing.assert_close(down(x), x @ down.packed.to_dense().T, rtol=1e-4, atol=1e-4)


# The last test on the fixture's engine: it fills blocks of its cache with random K/V.
def test_a_sequence_whose_blocks_moved_is_gathered_afresh(slice_compiled):
    """The step keeps one sequence's K/V between calls only while the sequence goes on in the
    same blocks: the same context in other blocks (a swap, a copy) is read from them again, and
    gives the same logits as a fresh start."""
    from engine.core.scheduler_output import SchedulerOutput

    llm = slice_compiled[0]
    runner, compiled = llm.engine.runner, llm.engine.compiled
    cache, bs = runner.kv_cache, runner.block_size
    torch.manual_seed(1)
    cache[:8].copy_(torch.randn_like(cache[:8]))
    cache[8:16].copy_(cache[:8])  # the same K/V in blocks 8..15

    def step(blocks, length, fresh=False):
        if fresh:
            compiled.forget()
        logits, best = compiled.decode(11, length - 1, blocks, length, cache, bs)
        assert torch.equal(best, logits.argmax(-1))  # the graph's argmax, which greedy sampling takes
        return logits

    first = step(list(range(8)), 3 * bs + 1, fresh=True)
    kept = compiled._buffer
    assert torch.equal(step(list(range(8)), 3 * bs + 1), first)  # the same step again, from the kept buffer
    step(list(range(8)), 3 * bs + 2)  # and the next one
    assert compiled._buffer is kept
    moved = step(list(range(8, 16)), 3 * bs + 1)  # the same context in other blocks: gathered from them
    assert compiled._buffer is not kept and torch.equal(moved, first)
    runner.execute(SchedulerOutput(blocks_to_copy=[(63, 63)]))  # any block move forgets it
    assert compiled._buffer is None


def test_forward_ab_variant_runs_the_compiled_step(slice_compiled, slice_dir, monkeypatch):
    """benchmarks/variants/compiled_step.py times the compiled step against the eager forward on
    one captured step, a lone chat's and a batch's: their logits match the eager forward's (fp32),
    and the base is left as it was."""
    for chats in (1, 3):
        compiled = run_forward_ab(slice_dir, "float32", monkeypatch, chats)
        assert compiled["same_greedy"] and compiled["max_abs_diff"] < 1e-4


# ---- once the slice's builds have ended: tests that replace what a build reads ---------------


def test_a_failed_build_leaves_the_engine_eager(builds_settled, packages, tiny_model_dir, deep_model_dir, monkeypatch):
    llm = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=16, compile_decode=False)
    # No fp16 build exists. One kind's failure is enough here (each costs a build process's
    # imports); that the next kind is still tried after one fails, the planted-package test shows.
    broken = CompiledSteps(tiny_model_dir, torch.float16, llm.engine.model, ("lone",)).start()
    assert not broken.wait(BUILD_TIMEOUT_S)
    assert "exited with 2" in broken.error and "float16" in broken.error
    monkeypatch.setattr(builds, "BUILD_TIMEOUT_S", 0.5)  # a build that hangs is stopped
    slow = CompiledSteps(deep_model_dir, torch.float32, llm.engine.model)
    assert not slow.wait(60) and "took over 0.5 s" in slow.error
    assert not package_path(deep_model_dir, torch.float32).exists()
    assert steps.supported(torch.device("cpu"), torch.float16) is not None
    assert steps.supported(torch.device("meta"), torch.float32) is not None


def test_a_package_planted_in_the_folder_is_never_loaded(fake_builds, loads, tiny_model_dir, caplog):
    """A package no build of ours recorded a digest for is refused, and built afresh."""
    fake_builds.folder.mkdir()
    paths = plant(fake_builds.folder, tiny_model_dir, b"planted")
    with caplog.at_level(logging.WARNING, logger=steps.__name__):
        serve_eagerly(tiny_model_dir)
    assert loads == []
    assert fake_builds.starts() == ["lone", "flat"]
    refusals = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(refusals) == 2 and all("no recorded digest" in m for m in refusals)
    assert paths[0].name in refusals[0] and paths[1].name in refusals[1]


def test_packages_of_a_kind_no_longer_built_are_removed(fake_builds, loads, tiny_model_dir):
    """A package of a kind no engine builds any more (an older engine's batch-of-decodes step) is
    removed, its digest with it, when an engine prepares its own; the current kinds' stay."""
    fake_builds.folder.mkdir()
    current = plant(fake_builds.folder, tiny_model_dir, b"built", digest_of=b"built")
    retired = fake_builds.folder / "batch-decode-tiny-llama-float32-0123456789abcdef0123.pt2"
    retired.write_bytes(b"an older engine's")
    package_trust.digest_path(retired).write_text(sha256_record(b"an older engine's", retired.name))
    serve_eagerly(tiny_model_dir)  # the stand-in loader refuses the current ones: eager it stays
    assert not retired.exists() and not package_trust.digest_path(retired).exists()
    assert all(path.exists() and package_trust.digest_path(path).exists() for path in current)


def test_a_package_whose_digest_does_not_match_is_rebuilt_before_it_loads(fake_builds, loads, tiny_model_dir):
    fake_builds.folder.mkdir()
    fake_builds.mode("rebuild")
    lone, flat = plant(fake_builds.folder, tiny_model_dir, b"planted", digest_of=b"what a build wrote")
    serve_eagerly(tiny_model_dir)
    assert fake_builds.starts() == ["lone", "flat"]
    assert loads == [(lone, b"rebuilt lone"), (flat, b"rebuilt flat")]  # only what the build installed


def test_a_server_core_loads_built_steps_before_its_first_request(fake_builds, tiny_model_dir, monkeypatch):
    """Both packages built: a server's core loads them before it takes requests (loading holds
    the GIL for seconds; started by the first step, it stalled the first chats' streams). One
    missing: nothing happens until the first step starts its build, as before."""
    from engine.runtime.engine_core import EngineCore

    fake_builds.folder.mkdir()
    lone, flat = plant(fake_builds.folder, tiny_model_dir, b"built", digest_of=b"built")
    loaded = fake_loads(monkeypatch)
    core = EngineCore(tiny_model_dir, dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    assert core.compiled.all_built() and not core.compiled.started
    core.load_compiled_steps_if_built()
    assert [p.path.name for p in loaded] == [lone.name, flat.name] and core.compiled.ready and core.compiled.flat_ready
    assert not core.compiled_pending() and fake_builds.starts() == []
    flat.unlink()
    core = EngineCore(tiny_model_dir, dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    core.load_compiled_steps_if_built()
    assert not core.compiled.all_built() and not core.compiled.started
    assert [p.path.name for p in loaded] == [lone.name, flat.name]


class FakePackage:
    """A stand-in for a loaded package (`LoadedPackage`): runs nothing, keeps the constants it is handed."""

    def __init__(self, path: Path) -> None:
        self.path, self.constants, self.options = path, None, None

    def __call__(self, *inputs):
        return None

    def load_constants(self, constants: dict, **options) -> None:
        self.constants, self.options = constants, options


def fake_loads(monkeypatch) -> list[FakePackage]:
    loaded = []

    def load(path):
        loaded.append(FakePackage(Path(path)))
        return loaded[-1]

    monkeypatch.setattr(steps, "LoadedPackage", load)
    return loaded


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    pointer = torch.ops.mkldnn.data_ptr if a.is_mkldnn else torch.Tensor.data_ptr
    return a.is_mkldnn == b.is_mkldnn and a.shape == b.shape and pointer(a) == pointer(b)


def test_the_packages_multiply_by_the_engines_own_weights(fake_builds, tiny_model_dir, monkeypatch):
    """Neither package holds weights. Loaded, the flat package is handed every weight the eager
    path multiplies by (a matmul's packed copy where there is one), the tensors themselves, to keep
    (user-managed), not copies; the lone package the engine's embedding and norms themselves, and
    each matrix's packed copy read in place, or where oneDNN lays it out otherwise, laid out for one
    row (`MatVec` blocks), made from the engine's matrix."""
    from engine.runtime.engine_core import EngineCore

    fake_builds.folder.mkdir()
    plant(fake_builds.folder, tiny_model_dir, b"built", digest_of=b"built")
    loaded = fake_loads(monkeypatch)
    core = EngineCore(tiny_model_dir, dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    core.load_compiled_steps_if_built()
    lone, flat = loaded
    assert flat.options == lone.options == {"check_full_update": True, "user_managed": True}
    model = core.model
    shared = {"embed": model.embed, "norm": model.norm.weight}
    engine_weights = {**shared, "lm_head": model.lm_head.batch_weight}
    for i, layer in enumerate(model.layers):
        norms = {f"layers.{i}.input_norm": layer.input_norm.weight, f"layers.{i}.post_norm": layer.post_norm.weight}
        shared.update(norms)
        engine_weights.update({**norms, **{f"layers.{i}.{name}": getattr(layer, name).batch_weight
                                           for name in ("qkv", "o_proj", "gate_up", "down")}})
        if layer.qkv.bias is not None:
            engine_weights[f"layers.{i}.qkv_bias"] = layer.qkv.bias
    assert set(flat.constants) == set(engine_weights)
    assert all(same_memory(flat.constants[name], weight) for name, weight in engine_weights.items())
    if torch.backends.mkldnn.is_available():  # fp32: every matmul's weight is oneDNN's packed copy
        assert model.layers[0].qkv.batch_weight.is_mkldnn

    assert all(same_memory(lone.constants[name], weight) for name, weight in shared.items())
    # Each matrix once: its packed copy read in place where oneDNN lays it out in blocks of 64
    # output features (packed_rows.py; a tied head's rows are the embedding, held under that
    # name), else laid out for one row (`MatVec` blocks), made from it.
    parts = [(f"layers.{i}.{name}", getattr(layer, name)) for i, layer in enumerate(model.layers)
             for name in ("qkv", "o_proj", "gate_up", "down")] + [("head", model.lm_head)]
    in_place = 0
    for name, linear in parts:
        single = name.endswith(("o_proj", "down"))  # one module; the others a list of parts
        if linear.rows is not None:
            rows = lone.constants["embed" if linear is model.lm_head and model.tied else
                                  f"{name}.rows" if single else f"{name}.0.rows"]
            assert rows.data_ptr() == torch.ops.mkldnn.data_ptr(linear.packed)
            assert rows.numel() == linear.out_features * linear.in_features
            in_place += 1
        else:
            blocks = lone.constants[f"{name}.blocks" if single else f"{name}.0.blocks"]
            first = linear.out_features if single else blocks.shape[0] * blocks.shape[2]
            assert torch.equal(blocks, MatVec(plain_matrix(linear)[:first]).blocks)
    if torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert in_place == len(parts)  # the blocks of 64 oneDNN lays fp32 out in with AVX-512
    linears = [model.lm_head, *(getattr(layer, name) for layer in model.layers
                                for name in ("qkv", "o_proj", "gate_up", "down"))]
    matrices = sum(t.numel() for name, t in lone.constants.items() if name.endswith((".blocks", ".rows")))
    tied_rows = lone.constants["embed"].numel() if model.lm_head.rows is not None and model.tied else 0
    assert matrices + tied_rows >= sum(linear.out_features * linear.in_features for linear in linears)  # each once
    # A server's core loads built packages before requests, with no plain copy beside a packed one
    # (its compiled steps read the packed ones): one layout held.
    assert all(linear.weight is None for linear in linears if linear.packed is not None)


def test_an_engine_that_compiles_keeps_no_plain_copy_beside_a_packed_one(fake_builds, tiny_model_dir):
    """fp32: an engine whose compiled steps will run its decodes packs each matrix and keeps no
    plain copy beside it, from the load on (the load never holds both); a `Linear` made for a path
    that chooses between them keeps both."""
    from engine.runtime.engine_core import EngineCore
    from engine.worker.models.layers.linear import Linear

    weight = torch.randn(128, 64)
    if Linear(weight).packed is None:
        pytest.skip("oneDNN does not pack fp32 here: every matrix is plain only")
    assert Linear(weight).weight is weight and Linear(weight, plain_copy=False).weight is None
    fake_builds.folder.mkdir()
    core = EngineCore(tiny_model_dir, dtype="float32", num_gpu_blocks=16, num_cpu_blocks=0, compile_decode=True)
    model = core.model
    linears = [model.lm_head, *(getattr(layer, name) for layer in model.layers
                                for name in ("qkv", "o_proj", "gate_up", "down"))]
    assert all(linear.weight is None and linear.packed is not None for linear in linears)


def _group_writable(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o775)


def _world_writable(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o757)


def _another_users(folder: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a folder to another user")
    folder.mkdir()
    os.chown(folder, 65534, 65534)


def _under_a_folder_others_can_write(folder: Path) -> None:
    folder.parent.chmod(0o777)  # no sticky bit: anyone may rename the packages folder away
    folder.mkdir()


@pytest.mark.parametrize("make_unsafe", [_group_writable, _world_writable, _another_users,
                                         _under_a_folder_others_can_write])
def test_packages_in_a_folder_others_can_write_are_neither_loaded_nor_built(fake_builds, loads, tiny_model_dir,
                                                                           caplog, make_unsafe):
    """Even a package whose digest matches: whoever can write the folder can write the record."""
    make_unsafe(fake_builds.folder)
    plant(fake_builds.folder, tiny_model_dir, b"package", digest_of=b"package")
    with caplog.at_level(logging.WARNING, logger=steps.__name__):
        llm = serve_eagerly(tiny_model_dir)
    assert loads == [] and fake_builds.starts() == []
    assert str(fake_builds.folder) in llm.engine.compiled.error
    assert any(str(fake_builds.folder) in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_a_background_build_yields_the_cpu_even_in_a_session_of_its_own():
    """A build runs in a session of its own; where the kernel schedules sessions as groups
    (autogroups), its nice value alone left it a whole core beside the engine: the group's nice
    value is raised too."""
    code = ("import os; from pathlib import Path; from engine.worker.compiled.builds import lower_priority; "
            "before = os.nice(0); lower_priority(); group = Path('/proc/self/autogroup'); "
            "print(os.nice(0) - before, group.read_text().split()[-1] if group.exists() else 'none')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                          start_new_session=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    raised, group_nice = done.stdout.split()
    assert int(raised) == 10
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    if enabled.exists() and enabled.read_text().strip() == "1":
        assert group_nice == "19"


def test_a_hung_build_is_stopped_with_its_whole_process_group(fake_builds, loads, tiny_model_dir, monkeypatch):
    """On its timeout a build is ended with every process it started (the compiler's workers),
    and what it left (half a package, its scratch folder) is removed."""
    fake_builds.mode("hang")
    monkeypatch.setattr(builds, "BUILD_TIMEOUT_S", 3)
    llm = serve_eagerly(tiny_model_dir)
    assert "took over 3 s" in llm.engine.compiled.error
    for kind in KINDS:
        pid, pgrp, worker, scratch = fake_builds.pids(kind)
        assert wait_until(lambda: not alive(worker)), f"the {kind} build's worker outlived its timeout"
        assert pgrp == pid, "the build did not run in a process group of its own"
        assert wait_until(lambda: not group_members(pgrp))
        assert not Path(scratch).exists()
    assert list(fake_builds.folder.iterdir()) == [] and loads == []


def test_constrained_replies_through_the_compiled_steps_equal_the_eager_ones(slice_compiled, slice_dir, monkeypatch):
    """A grammar masks the logits whichever way the step ran: a lone chat through the compiled lone
    step and three chats through the flat step give the eager engine's greedy constrained tokens."""
    llm = slice_compiled[0]
    lone_calls = count_calls(monkeypatch, llm.engine.compiled)
    flat_calls = count_calls(monkeypatch, llm.engine.compiled, "run_flat")
    eager = LLM(slice_dir, dtype="float32", num_gpu_blocks=64, compile_decode=False)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "people": {"type": "integer", "minimum": 0, "maximum": 99999}},
              "required": ["city", "people"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    chats = ["Paris as JSON:", "The biggest city you know:", "A record of a town:"]
    for prompts in (chats[:1], chats):
        ours = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [o.token_ids for o in ours] == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        assert all(o.finish_reason == "stop" and set(json.loads(o.text)) == {"city", "people"} for o in ours)
    assert lone_calls and any(len(seqs) == 3 for seqs in flat_calls)
