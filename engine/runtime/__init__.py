"""The engine at run time: the core that steps requests (engine_core.py), the process it may run
in (core_process.py), and the clients that feed it and stream what it hands back — on a thread of
this process (thread_client.py) or talking to the core's process (process_client.py), both on
streaming_client.py's base; llm_engine.py is the core with the frontend's text processing, on
the caller's thread."""
