"""The engine's command-line options, shared by every subcommand that builds an engine (vLLM's
names, as its arg_utils.py), and the EngineConfig they make."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Optional


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that builds an engine (vLLM's names)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="mlx-lm folder or hub name, a .gguf file, random:llama-tiny (a random-weight test model) "
                        "or preset:NAME (random weights at a real model's widths, in --dtype: llama-8b, "
                        "gemma3-27b-16l, gemma4-e2b-16l, qwen3.5-27b-16l, qwen3.6-35b-a3b-16l, ...) "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in pages")
    pool.add_argument("--kv-cache-gb", type=float, default=None,
                      help="KV pool size in GB (default: sized by --gpu-memory-utilization on a GPU, by the model's "
                           "size on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the fraction of the GPU's memory (Metal: MLX's recommended working set) the weights, one "
                        "step's peak and the KV pool may take together; the pool gets the rest (default 0.9)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "int4"],
                   help="what KV pages hold: the model's dtype (auto) or affine int8 / int4 with a scale and bias "
                        "per group of channels, as mlx-lm's quantized KV cache (default auto)")
    p.add_argument("--kv-cache-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="channels per scale and bias of quantized pages (default: 128 or 64 for int8, 64 for int4)")
    p.add_argument("--kv-cache-rotate", action=argparse.BooleanOptionalAction, default=False,
                   help="quantized pages: rotate each head's keys and values by a Hadamard matrix before quantizing "
                        "(outlier channels spread over the group: int4 loses much less; head dims powers of 2)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 8192 on a GPU, 512 on the CPU)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="largest prefill chunk of one request while others decode (0: no cap; "
                        "default: 256 on CUDA, 512 elsewhere)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV pages of common prefixes between requests")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="build step N+1 while step N runs (default: on GPU backends)")
    p.add_argument("--compilation-config", "-O", default=None, metavar="JSON",
                   help="kernel and graph switches as one JSON object (vLLM's option), each true, false or null "
                        "(null: where it pays): compile_decode (replay decode-only steps through mx.compile, CUDA; "
                        "default: steps of at most 8 requests), merge_projections (q/k/v and gate/up as one matmul "
                        "each; default: GPU backends), fuse_norms (residual add + RMSNorm as one kernel; "
                        "default off), skinny_gemm (products of 2-5 rows as pagedmlx's kernel; default: CUDA), "
                        "quantized_gemm (4- and 8-bit products of 1-256 rows as pagedmlx's kernel; default: CUDA), "
                        "warm_up_attention (build long prompts' attention shapes before serving; default: CUDA), "
                        "prefill_kernel (the paged prefill kernel; default: CUDA). Example: "
                        "-O '{\"skinny_gemm\": false}'")
    for name in ("compile-decode", "merge-projections", "fuse-norms", "skinny-gemm", "quantized-gemm",
                 "warm-up-attention", "prefill-kernel"):
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"the same as --compilation-config '{{\"{key}\": true}}' (or false with --no-{name})")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="sampling defaults: the model's generation_config.json (auto) or vLLM's own (vllm)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype of unquantized weights (default: as loaded)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting-queue order (priority: a request's `priority`, lower first)")
    p.add_argument("--state-checkpoint-interval", type=int, default=1024,
                   help="models with recurrent state: save a state checkpoint every so many tokens (0: none), "
                        "besides each prompt's last full block; prefix hits resume only from checkpoints")
    p.add_argument("--max-state-checkpoints", type=int, default=None,
                   help="state slots for checkpoints beside the max-num-seqs running ones (default: max-num-seqs)")
    lora = p.add_argument_group("LoRA adapters (mlx-lm's LoRA and DoRA, batched: each row its own)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="adapters among running requests at once (requests for others wait; default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept read in the engine (others are read again from their folders when "
                           "used; default: --max-loras)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; method draft_model with a \"model\"; "
                        "method mtp: a Qwen3.5 / Qwen3-Next checkpoint's own MTP module; with either, "
                        "\"prompt_lookup_max\" also looks the context up (the n-gram's draft where it pays more) "
                        "(also disable_by_batch_size, min_acceptance_rate; default: off)")


def _speculative_config(text: str):
    from pagedmlx.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_any(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_arg(args: argparse.Namespace) -> Optional[str]:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit(f"pagedmlx: two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model


# argparse types shared by the commands: a value out of range is refused at parse (exit 2), naming the flag.

def positive(kind: type) -> Callable[[str], object]:
    """argparse type: a `kind` (int, float) > 0."""
    return _bounded(kind, lambda v: v > 0, "> 0")


def non_negative(kind: type) -> Callable[[str], object]:
    """argparse type: a `kind` (int, float) >= 0."""
    return _bounded(kind, lambda v: v >= 0, ">= 0")


def _bounded(kind: type, ok: Callable[[object], bool], what: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        value = kind(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def port_number(text: str) -> int:
    """argparse type of a server's --port: a TCP port, 0-65535 (0: any free one)."""
    return _port(text, 0)


def server_port(text: str) -> int:
    """argparse type of a client's --port: the port a server listens on, 1-65535."""
    return _port(text, 1)


def _port(text: str, lowest: int) -> int:
    value = int(text)
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [{lowest}, 65535], got {text}")
    return value


def engine_config(args: argparse.Namespace):
    """The EngineConfig of the command's engine options; a value it refuses exits with status 2 and its
    reason on stderr, as argparse does for a bad flag."""
    try:
        return _engine_config(args)
    except ValueError as exc:
        print(f"pagedmlx: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _engine_config(args: argparse.Namespace):
    from pagedmlx.config import EngineConfig

    return EngineConfig(model=model_arg(args), block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_dtype=args.kv_cache_dtype, kv_cache_group_size=args.kv_cache_group_size,
                        kv_cache_rotate=args.kv_cache_rotate,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                        async_scheduling=args.async_scheduling, warm_up_attention=args.warm_up_attention,
                        prefill_kernel=args.prefill_kernel, compile_decode=args.compile_decode,
                        merge_projections=args.merge_projections, fuse_norms=args.fuse_norms or False,
                        skinny_gemm=args.skinny_gemm, quantized_gemm=args.quantized_gemm,
                        compilation_config=args.compilation_config,
                        generation_config=args.generation_config,
                        scheduling_policy=args.scheduling_policy, dtype=args.dtype,
                        state_checkpoint_interval=args.state_checkpoint_interval,
                        max_state_checkpoints=args.max_state_checkpoints, enable_lora=args.enable_lora,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras,
                        speculative_config=args.speculative_config)
