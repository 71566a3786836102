"""Decoders written for the engine: one flattened batch of tokens from many requests, no padding."""
