"""The OpenAI-compatible server over the tiny model, in this process, for the API test modules
that share its shape (module-scoped: import the fixtures into the module), and `running`, the same
server over any engine client."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
from openai import OpenAI
from served_app import Served

from engine import EngineClient, LLMEngine
from engine.serve import build_server


@contextmanager
def running(client: EngineClient, api_key: str | None = None):
    """`python -m engine.serve`'s app over `client` on a free loopback port, in this process: its URL."""
    served = Served(build_server(client, "tiny", api_key))
    try:
        yield served.url.rstrip("/")
    finally:
        served.close()


@pytest.fixture(scope="module")
def engine_client(tiny_model_dir):
    client = EngineClient(LLMEngine(tiny_model_dir, num_gpu_blocks=128, num_cpu_blocks=16), max_waiting=16)
    yield client
    client.close()


@pytest.fixture(scope="module")
def url(engine_client):
    with running(engine_client) as base:
        yield base


@pytest.fixture(scope="module")
def openai(url):
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
