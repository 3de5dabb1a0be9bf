"""Structured outputs: JSON schemas, regexes, choices and grammars that a request's output must follow.

params.py   StructuredOutputsParams (vLLM's fields), the request's side
backend.py  llguidance: compile (cached by spec) and matchers over the model's tokens
manager.py  the engine's side: compiles off the engine thread, a matcher per sequence, per-step masks
"""

from pagedserve.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
