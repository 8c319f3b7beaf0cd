"""EngineConfig: every knob of the engine in one validated place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pagedmlx.core.kv.cache_dtype import GROUP_SIZES, normalize_kv_cache_dtype
from pagedmlx.spec_decode.config import SpeculativeConfig

__all__ = ["EngineConfig", "SpeculativeConfig", "COMPILATION_SWITCHES", "compilation_switches"]

# The keys of --compilation-config / EngineConfig.compilation_config: None (the default: where it pays) or a bool.
COMPILATION_SWITCHES = ("compile_decode", "merge_projections", "fuse_norms", "skinny_gemm", "quantized_gemm",
                        "warm_up_attention", "prefill_kernel")


def compilation_switches(value: Any) -> dict[str, Optional[bool]]:
    """The switches a compilation_config (None, a dict or its JSON text) sets; an unknown key or a value other than
    true / false / null is a ValueError naming it."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"compilation_config must be a JSON object, got {value!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"compilation_config must be a JSON object, got {value!r}")
    for key, switch in value.items():
        if key not in COMPILATION_SWITCHES:
            raise ValueError(f"compilation_config: unknown key {key!r} (known: {', '.join(COMPILATION_SWITCHES)})")
        if switch not in (None, True, False):
            raise ValueError(f"compilation_config: {key} must be true, false or null, got {switch!r}")
    return dict(value)


@dataclass
class EngineConfig:
    model: Optional[str] = None  # mlx-lm folder or hub name, a .gguf file; None: the default model
    block_size: int = 16
    num_blocks: Optional[int] = None  # None: sized from the KV budget below
    # The KV budget (pages and recurrent-state slots): kv_cache_memory_gb GB when given; else, on a GPU backend,
    # what gpu_memory_utilization of the device's memory leaves after the weights and a profiled step (vLLM's
    # way), and on the CPU the model's own size (runner/kv_budget.py).
    kv_cache_memory_gb: Optional[float] = None
    gpu_memory_utilization: float = 0.9
    # What the KV pages hold (vLLM's option): "auto" (the model's dtype), "int8" or "int4" (affine, a scale and
    # bias per kv_cache_group_size channels, as mlx-lm's QuantizedKVCache; docs/kv-quantization.md). Recurrent
    # state stays in full precision. kv_cache_group_size None: 128 (or 64) for int8, 64 for int4.
    kv_cache_dtype: str = "auto"
    kv_cache_group_size: Optional[int] = None
    # Quantized pages: each head's keys and values are rotated by a Hadamard matrix before they are quantized
    # (queries and outputs to match: attention is unchanged up to rounding), which spreads outlier channels
    # over the group; int4's quality loss shrinks several-fold (docs/kv-quantization.md). Head dims: powers of 2.
    kv_cache_rotate: bool = False
    max_num_seqs: int = 256
    # A step's token budget. None: 8192 on GPU backends, 512 on the CPU (fewer, larger
    # chunks won on an H200, chunks past 512 tokens lost on a 2-core CPU).
    max_num_batched_tokens: Optional[int] = None
    # While other requests decode, one request's prefill chunk takes at most this many tokens (their
    # inter-token latency); a prompt with no decode beside it takes the whole budget. 0: no cap. None:
    # 256 on CUDA, 512 elsewhere (on an H200, 64 decodes beside a 16k prompt stepped fastest with 256-token chunks).
    long_prefill_token_threshold: Optional[int] = None
    max_model_len: Optional[int] = None  # None: the model's own limit (or 8192), capped at the pool
    enable_prefix_caching: bool = True
    # Models with recurrent state (Qwen3.5, Mamba2, ...): a prefix hit resumes from a state checkpoint,
    # saved every this many tokens (rounded up to whole blocks; 0: none) and at each prompt's last full block.
    # The state pool holds max_num_seqs running slots plus max_state_checkpoints (None: max_num_seqs) more;
    # checkpoints keep every slot no request holds, least recently used evicted first.
    state_checkpoint_interval: int = 1024
    max_state_checkpoints: Optional[int] = None
    scheduling_policy: str = "fcfs"  # or "priority"
    # Schedule and build step N+1 while step N runs on the device. None: on GPU backends only (on a
    # CPU the host work competes with the forward pass for the cores: docs/benchmarks.md).
    async_scheduling: Optional[bool] = None
    async_min_batch: int = 1  # running requests from which steps overlap (1: every step)
    # Decode-only steps traced once per shape key and replayed through mx.compile (vLLM's CUDA graphs in
    # spirit: runner/compiled_step.py), where the pages are written in place (CUDA). None: steps of at
    # most compiled_step.AUTO_MAX_DECODES requests at once (where the host's Python is the step's cost),
    # larger ones once their key has come HOT_STEPS times (a steady batch; not for recurrent-state models);
    # True: every step at once.
    compile_decode: Optional[bool] = None
    # The projections a layer applies to one input (q/k/v, gate/up, ...) as one product over their
    # concatenated weights (layers/merged_linear.py: vLLM's merged layers; gate/up and Gated DeltaNet's inputs
    # on every step, the others on single-row steps). None: on GPU backends, where a small step is bound by
    # kernel dispatch (on the CPU, BLAS picks kernels by shape, so merged products may differ from mlx-lm's in
    # the last bit). LoRA adapters add their rows to a merged module's part (the LoRA kernel reads it in place).
    merge_projections: Optional[bool] = None
    # Residual adds fused with the RMSNorm after them (layers/fused_residual.py, kernels/add_rms_norm.py): two
    # launches a layer fewer, where the kernel runs (a GPU backend) and passes its load-time check and the model
    # its probe. Off by default: on an H100 it made Llama-8B's batch-1 decode slower (docs/kernels.md).
    fuse_norms: bool = False
    # Products of plain linear layers over 2-5 rows (speculative verifying steps, decodes of a few requests) as one
    # kernel of ours (layers/skinny_linear.py, kernels/skinny_gemm.py) instead of MLX's matmul, which on CUDA runs
    # 2+ rows through cuBLASLt at several times the kernel's host time a call (PAGEDMLX_SKINNY_MAX_ROWS). None: on
    # CUDA, off elsewhere (Metal's matmul has no such host cost). Its load-time check builds kernels at start-up.
    skinny_gemm: Optional[bool] = None
    # Products of quantized linear layers (MLX's affine 4 and 8 bits) over 1-256 rows as one kernel of ours that
    # dequantizes in registers (layers/quantized_linear.py, kernels/quantized_gemm.py) instead of MLX's quantized
    # matmul. None: on CUDA where it passes its load-time check; off elsewhere.
    quantized_gemm: Optional[bool] = None
    # "auto": sampling defaults from the model's generation_config.json (as vLLM); "vllm": vLLM's own.
    generation_config: str = "auto"
    dtype: Optional[str] = None  # "float32" / "float16" / "bfloat16" for unquantized weights; None: as loaded
    # Prefill attention shapes are padded to multiples of this (runner/attention_metadata.py: CUDA
    # builds a cuDNN graph per shape). None: 256 on CUDA, 0 (none) elsewhere.
    sdpa_quantum: Optional[int] = None
    # Build at start-up, in the thread that steps, the attention shapes a long prompt's chunks meet
    # (up to WARM_UP_MAX_KEYS tokens), so that the first long prompt does not stall the decodes beside
    # it. None: wherever shapes are padded (CUDA).
    warm_up_attention: Optional[bool] = None
    # Prefill rows attend through the paged prefill kernel (CUDA, 16-bit models: every segment of a
    # step in one launch, keys read from the pages) instead of MLX's attention on gathered pages.
    # None: wherever the kernels run; False: never.
    prefill_kernel: Optional[bool] = None
    # Batched multi-LoRA (vLLM's LoRAConfig, pagedmlx/lora/): requests may name an mlx-lm LoRA or DoRA
    # adapter; a step's rows each use their own. max_loras adapters at most among running requests
    # (device slots), of rank max_lora_rank at most; max_cpu_loras read adapters kept (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # Speculative decoding (vLLM's speculative_config: a SpeculativeConfig, or its dict or JSON text;
    # None: off). pagedmlx/spec_decode/.
    speculative_config: Any = None
    # vLLM's compilation_config: the kernel and graph switches above (compile_decode, merge_projections, fuse_norms,
    # skinny_gemm, quantized_gemm, warm_up_attention, prefill_kernel) as one dict or JSON text; a key given there
    # sets that field.
    compilation_config: Any = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        for name, value in compilation_switches(self.compilation_config).items():
            setattr(self, name, value)
        self.kv_cache_dtype = normalize_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_group_size is not None and self.kv_cache_group_size not in GROUP_SIZES:
            raise ValueError(f"kv_cache_group_size must be one of {', '.join(map(str, GROUP_SIZES))} (or None), "
                             f"got {self.kv_cache_group_size!r}")
        if self.kv_cache_rotate not in (True, False):
            raise ValueError(f"kv_cache_rotate must be true or false, got {self.kv_cache_rotate!r}")
        if self.kv_cache_rotate and self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_rotate applies to quantized pages only (kv_cache_dtype int8 or int4), "
                             "got kv_cache_dtype 'auto'")
        if self.kv_cache_group_size is not None and self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_group_size applies to quantized pages only (kv_cache_dtype int8 or int4), "
                             "got kv_cache_dtype 'auto'")
        if self.max_num_batched_tokens is None:
            import mlx.core as mx

            self.max_num_batched_tokens = 8192 if mx.default_device() == mx.gpu else 512
        if self.long_prefill_token_threshold is None:
            import mlx.core as mx

            self.long_prefill_token_threshold = 256 if mx.default_device() == mx.gpu and mx.cuda.is_available() else 512
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "async_min_batch", "max_loras",
                     "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError("kv_cache_memory_gb must be > 0 (or None: sized by memory), "
                             f"got {self.kv_cache_memory_gb}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: no cap), got {self.long_prefill_token_threshold}")
        if self.sdpa_quantum is not None and (not isinstance(self.sdpa_quantum, int) or self.sdpa_quantum < 0):
            raise ValueError(f"sdpa_quantum must be an integer >= 0 (0: no padding), got {self.sdpa_quantum!r}")
        if self.state_checkpoint_interval < 0:
            raise ValueError(f"state_checkpoint_interval must be >= 0, got {self.state_checkpoint_interval}")
        if self.max_state_checkpoints is not None and self.max_state_checkpoints < 0:
            raise ValueError(f"max_state_checkpoints must be >= 0, got {self.max_state_checkpoints}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
