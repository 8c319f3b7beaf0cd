"""What the front end needs to know of an engine core: its limits, its tokenizer, and the lines
the server prints at start (the same whether the core steps in a thread or in its own process)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pagedmlx.platform import backend_name


@dataclass
class CoreInfo:
    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, Any]
    tokenizer: Any
    model: Any  # the config's model argument (None: the default model)
    max_num_seqs: int
    kv_pool: str  # kv_pool_line's text
    rank_lines: list[str] = field(default_factory=list)  # tensor parallelism: one line per rank
    kernel_lines: list[str] = field(default_factory=list)  # per KV cache group: the kernels its layers run
    backend: str = ""
    pid: int = 0
    max_loras: int = 0  # LoRA adapters among running requests (0: LoRA not enabled)
    max_lora_rank: int = 0
    # Images (pagedmlx/multimodal/): the core serves them, or why a vision-language model serves text only
    takes_images: bool = False
    images_refused: str = ""
    start_line: str = ""  # start_line's text

    @classmethod
    def of(cls, core: Any) -> "CoreInfo":
        return cls(core.max_model_len, core.vocab_size, dict(core.generation_defaults), core.tokenizer,
                   core.config.model, core.config.max_num_seqs, kv_pool_line(core),
                   list(getattr(core, "rank_lines", [])), kernel_lines(core), backend_name(), os.getpid(),
                   core.config.max_loras if core.config.enable_lora else 0, core.config.max_lora_rank,
                   *image_support(core), start_line(core))


def image_support(core: Any) -> tuple[bool, str]:
    """(takes_images, images_refused) of a core."""
    encoder = getattr(core, "mm_encoder", None)
    reason = getattr(encoder, "reason", "")
    return encoder is not None and not reason, reason


def rank0_runner(engine: Any) -> Any:
    """The core's ModelRunner; under tensor parallelism rank 0's (tp/driver.py's TPDriver wraps it)."""
    return getattr(engine.runner, "runner", engine.runner)


def kernel_lines(engine: Any) -> list[str]:
    """runner/kernel_paths.py's lines: which kernel each KV cache group's layers run, and why a
    portable path runs where one does (under tensor parallelism, rank 0's shard: every rank has its shapes)."""
    from pagedmlx.runner.kernel_paths import kernel_path_lines

    runner = rank0_runner(engine)
    return kernel_path_lines(runner) if hasattr(runner, "kernels") else []


def start_line(engine: Any) -> str:
    """Where the runner's start went (runner/start_times.py), then what the kernel disk cache gave: "41.2 s: skinny
    GEMM's check 30.6 s, ...; kernel cache ...: 14 kernel variants loaded, 0 compiled and kept"."""
    from pagedmlx.kernels.disk_cache import stats_line

    times = getattr(rank0_runner(engine), "start_times", None)
    return "; ".join(part for part in (times.line() if times is not None else "", stats_line()) if part)


def kv_pool_line(engine: Any) -> str:
    """Each KV cache group's pages: "4096 blocks x 16 tokens = 1.07 GB (int8 pages, 69,632 B/token)" (bytes
    per token: every layer of the group, scales included) or, for a hybrid model, one such part per group
    ("full: ...; sliding 1024: ..."), then how the budget was sized ("; sized by gpu_memory_utilization 0.9 x ...")."""
    config = engine.runner.kv_cache_config
    parts = [f"{g.num_blocks} blocks x {config.block_size} tokens = {g.num_blocks * g.page_size_bytes / 1e9:.2f} GB"
             f" ({g.kv_cache_dtype or 'KV'} pages, {g.page_size_bytes // config.block_size:,} B/token)"
             if not g.is_state else state_pool_text(g, engine.config.max_num_seqs) for g in config.kv_cache_groups]
    if len(parts) == 1 and not config.kv_cache_groups[0].is_state:
        line = parts[0]
    else:
        line = "; ".join(f"{g.name} ({len(g.layer_ids)} layers): {p}" for g, p in zip(config.kv_cache_groups, parts))
    budget = getattr(rank0_runner(engine), "kv_budget", None)
    return line + (f"; sized by {budget.how}" if budget is not None else "")


def state_pool_text(group: Any, max_num_seqs: int) -> str:
    """The recurrent-state slots: "128 slots (64 running + 64 checkpoints) x 147.0 MiB = 19.73 GB" (with
    speculative decoding, "+ 8 spare" too: the slots verifying steps write, MambaSpec)."""
    page = group.page_size_bytes
    size = f"{page / 2**20:.1f} MiB" if page >= 2**20 / 10 else f"{page / 2**10:.1f} KiB"
    spec = group.kv_cache_spec
    spare = spec.max_speculating * spec.num_speculative_blocks
    spare_text = f" + {spare} spare" if spare else ""
    return (f"{group.num_blocks} slots ({max_num_seqs} running{spare_text} + "
            f"{group.num_blocks - max_num_seqs - spare} checkpoints) x {size} = {group.num_blocks * page / 1e9:.2f} GB")


def defaults_line(generation_defaults: dict[str, Any], model: Any) -> str:
    if not generation_defaults:
        return "vLLM's (temperature 1.0, top_p 1.0); a request's own values win"
    source = "the model's generation config" if model else "the default model's card"
    return ", ".join(f"{k} {v}" for k, v in generation_defaults.items()) + f" ({source}); a request's own values win"
