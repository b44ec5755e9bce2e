"""Structured output with llguidance: grammars from vLLM's StructuredOutputsParams (grammar.py),
one matcher per constrained request and its per-step token bitmask (matcher.py)."""
