"""Structured output on the tensor side: a request's constraint (engine/core's
StructuredOutputsParams) as a grammar, compiled against the vocabulary off the engine loop, and a
matcher per request that masks each step's logits to the tokens the grammar allows (xgrammar)."""
