"""Sampling (vLLM's vllm/v1/sample): the batched sampler and the rejection sampler of speculative decoding."""
