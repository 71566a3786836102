"""The command line: one reply, and a terminal chat whose second turn hits the prefix cache."""
import os
import signal
import subprocess
import sys

from processes import group_members, processes_naming


def run_cli(args, stdin=""):
    return subprocess.run([sys.executable, "-m", "engine", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_one_prompt_streams_a_reply_and_a_status_line(tiny_model_dir):
    done = run_cli(["Hello there", "--model", tiny_model_dir, "--max-tokens", "6", "--temperature", "0"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "[6 tokens" in done.stderr and "finish: length" in done.stderr


def test_chat_turn_two_reuses_turn_one_from_the_prefix_cache(tiny_model_dir):
    done = run_cli(["--model", tiny_model_dir, "--max-tokens", "20", "--temperature", "0",
                    "--system", "You are a terse assistant who always answers in exactly one short sentence."],
                   stdin="What is a paged KV cache?\nAnd why does it help?\n\n")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "prompt tokens from the prefix cache" in line]
    assert len(lines) == 2
    second_cached = int(lines[1].split("; ")[1].split(" of ")[0])
    assert second_cached >= 32  # the system prompt and turn one, in whole blocks


def test_one_prompt_starts_no_compiled_build(deep_model_dir, tmp_path):
    """A one-shot reply ends long before a compiled step could be built (minutes), so it starts
    none: a build started there outlived the command, orphaned, and wrote into the cache."""
    folder = tmp_path / "compiled"
    env = {**os.environ, "PAGEDCHAT_COMPILE": "1", "PAGEDCHAT_COMPILED_DIR": str(folder)}
    command = [sys.executable, "-m", "engine", "Tell me a long story about a paged cache.", "--model", deep_model_dir,
               "--max-tokens", "80", "--seed", "1"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # whatever it starts stays in its group
    try:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        assert processes_naming("engine.worker.compiled_decode", str(folder)) == []
        assert group_members(process.pid) == []
        assert not folder.exists() or list(folder.iterdir()) == []
    finally:
        for pid in group_members(process.pid):
            os.kill(pid, signal.SIGKILL)
