"""The command line: one reply, and a terminal chat whose second turn hits the prefix cache."""
import subprocess
import sys


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
