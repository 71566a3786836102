"""The command line: one reply, and a terminal chat whose second turn hits the prefix cache."""
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from processes import group_members, processes_naming

MAX_TOKENS = 80


def run_cli(args, stdin=""):
    return subprocess.run([sys.executable, "-m", "engine", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


@dataclass
class OneShot:
    returncode: int
    stdout: str
    stderr: str
    leftover_builds: list[int]  # compiled-decode builds alive once the command has exited
    leftover_group: list[int]   # anything else of its process group still alive
    folder_entries: list[str]   # what it left in the compiled-package folder


@pytest.fixture(scope="module")
def one_shot(deep_model_dir, tmp_path_factory) -> OneShot:
    """One `python -m engine "prompt"` serves both one-prompt tests (a start of the command costs
    ~10 s of CPU): on the 48-layer model, with compiled steps on, so that the reply lasts long
    enough for a wrongly started build to show."""
    folder = tmp_path_factory.mktemp("cli") / "compiled"
    env = {**os.environ, "PAGEDCHAT_COMPILE": "1", "PAGEDCHAT_COMPILED_DIR": str(folder)}
    command = [sys.executable, "-m", "engine", "Tell me a long story about a paged cache.", "--model", deep_model_dir,
               "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # whatever it starts stays in its group
    try:
        out, err = process.communicate(timeout=300)
        return OneShot(process.returncode, out, err, processes_naming("engine.worker.compiled", str(folder)),
                       group_members(process.pid), sorted(os.listdir(folder)) if folder.exists() else [])
    finally:
        for pid in group_members(process.pid):
            os.kill(pid, signal.SIGKILL)


def test_one_prompt_streams_a_reply_and_a_status_line(one_shot):
    assert one_shot.returncode == 0, one_shot.stderr[-2000:]
    assert one_shot.stdout.strip()
    assert f"[{MAX_TOKENS} tokens" in one_shot.stderr and "finish: length" in one_shot.stderr


def test_chat_turn_two_reuses_turn_one_from_the_prefix_cache(tiny_model_dir):
    done = run_cli(["--model", tiny_model_dir, "--max-tokens", "20", "--temperature", "0",
                    "--system", "You are a terse assistant who always answers in exactly one short sentence."],
                   stdin="What is a paged KV cache?\nAnd why does it help?\n\n")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "prompt tokens from the prefix cache" in line]
    assert len(lines) == 2
    second_cached = int(lines[1].split("; ")[1].split(" of ")[0])
    assert second_cached >= 32  # the system prompt and turn one, in whole blocks


def test_one_prompt_starts_no_compiled_build(one_shot):
    """A one-shot reply ends long before a compiled step could be built (minutes), so it starts
    none: a build started there outlived the command, orphaned, and wrote into the cache."""
    assert one_shot.returncode == 0, one_shot.stderr[-2000:]
    assert one_shot.leftover_builds == []
    assert one_shot.leftover_group == []
    assert one_shot.folder_entries == []
