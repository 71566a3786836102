"""Tools for developing the engine without a model: a simulated runner that checks every block it
reads, the scheduler invariant checker, and `python -m engine.devtools.simulate`."""
