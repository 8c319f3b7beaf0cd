"""Speculative decoding inside the paged batch (vLLM's vllm/v1/spec_decode): a running request may
carry draft tokens (Request.spec_token_ids); the scheduler schedules them as more query tokens on the
request's pages, the sampler samples every row, and the engine keeps the drafts the target agrees with.

- config.py: SpeculativeConfig (vLLM's `speculative_config` JSON), plain data
- ngram_proposer.py: prompt lookup (vLLM's "ngram" method)
- draft_model.py: DraftModelProposer (vLLM's "draft_model" method): a small model on its own pages,
  addressed by the target's block ids
- drafter.py: which requests speculate (eligibility, adaptive pauses, the batch-size off-switch)
- metrics.py: SpecDecodingStats (vLLM's spec-decode counters)
"""

from pagedmlx.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
