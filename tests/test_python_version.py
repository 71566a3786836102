"""The project runs on Python 3.11 or later, and says so wherever a minimum is declared. On 3.10,
`asyncio.wait_for` raises `asyncio.TimeoutError`, not the builtin `TimeoutError` that the engine's
clients catch while a reply waits for its next token (engine/runtime/thread_client.py,
engine/runtime/streaming_client.py): every reply with a gap of over a second would be aborted."""
import asyncio
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_declared_minimum_is_3_11():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    readme = (ROOT / "README.md").read_text()
    assert "3.10" not in readme
    assert "`python3` (3.11+)" in readme
    space_python = readme.split("---\n")[1].split('python_version: "')[1].split('"')[0]
    assert tuple(map(int, space_python.split("."))) >= (3, 11)


def test_asyncio_timeouts_are_the_builtin_here():
    """What the clients' `except TimeoutError` relies on."""
    assert sys.version_info >= (3, 11)
    assert asyncio.TimeoutError is TimeoutError
