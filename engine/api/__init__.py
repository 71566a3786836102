"""The engine's OpenAI-compatible HTTP API (FastAPI) and its Prometheus metrics."""
from engine.api.server import add_openai_api

__all__ = ["add_openai_api"]
