"""The engine's steps compiled ahead of time by AOTInductor, once per machine (see steps.py)."""
