"""Guided decoding (structured outputs), vLLM's names: StructuredOutputsParams (params.py, plain
data on SamplingParams), the llguidance binding (backend.py) and the engine core's
StructuredOutputManager (manager.py). The sampler applies each step's bitmask on the device
(sampler.apply_grammar_bitmask)."""

from pagedmlx.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
