"""The engine core's bookkeeping (vLLM's vllm/v1/core): the scheduler (sched/) and the KV block accounting (kv/).
Neither imports MLX: they move token counts and block ids, never arrays."""
