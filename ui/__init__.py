"""PagedChat's browser UI (Gradio): talks to the engine only through `EngineClient` and to
storage only through `Store`."""
