"""The engine's OpenAI-compatible HTTP API (FastAPI) and its Prometheus metrics."""


def __getattr__(name: str):
    # The server pulls in FastAPI and the model side (torch); `engine.api.kv_cache` alone, which a
    # remote-only app reads JSON with, should not.
    if name == "add_openai_api":
        from engine.api.server import add_openai_api
        return add_openai_api
    raise AttributeError(f"module 'engine.api' has no attribute {name!r}")


__all__ = ["add_openai_api"]
