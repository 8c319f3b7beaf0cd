"""`pagedmlx doctor`: what this machine runs, in a form to paste into a bug report.

It prints the backend and device, whether each paged kernel compiled and passed its check here
(kernels/check.py, the check the engine runs at load, here with every kernel checked even
on a GPU that the project trusts), which kernel each layer of a model runs here (per KV cache
group, as the server's start-up lines say it: runner/kernel_paths.py, after the model's own
load-time check), and a decode step's time at a few batch sizes over a long context: paged
kernels on, off (pages gathered, the path every backend has), and mlx-lm's own BatchGenerator on
the same random-weight model.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

# A small Llama with Llama-8B's attention shape (head_dim 128, 4 query heads per kv head), so that
# attention, not the weights, is most of a long-context decode step; fits any Mac at 32 x 4k.
MODEL = dict(model_type="llama", hidden_size=1024, num_hidden_layers=4, intermediate_size=2816, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=32000, rms_norm_eps=1e-5, tie_word_embeddings=False)


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="print the backend, the paged kernels' checks and a decode timing table")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context per sequence (default: 4096 on a GPU, 512 on the CPU)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="batch sizes of the timing table (default: 1 8 32 on a GPU, 1 4 on the CPU)")
    p.add_argument("--steps", type=int, default=None,
                   help="decode steps timed per cell, median (default: 10 on a GPU, 5 on the CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", action="append", default=None,
                   help="a model whose layers' kernels to show (what `serve` takes: a folder, hub name, .gguf, "
                        "random:ARCH, preset:NAME in --dtype; repeat for several; default: the timing table's "
                        "random Llama, --dtype)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "int4"], default="auto",
                   help="what the --model layers' pages hold (the kernels table; the checks cover int8 and int4 "
                        "always)")
    p.add_argument("--no-timing", action="store_true",
                   help="only the backend, the kernel checks and the layers' kernels")


def run_doctor(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from rich.console import Console
    from rich.table import Table

    from pagedmlx.platform import backend_name
    from pagedmlx.kernels import build, check, selector

    console = Console()
    dtype = getattr(mx, args.dtype)
    backend = build.gpu_backend()
    on_gpu = mx.default_device() == mx.gpu
    args.context = args.context or (4096 if on_gpu else 512)
    args.batch_sizes = args.batch_sizes or ([1, 8, 32] if on_gpu else [1, 4])
    args.steps = args.steps or (10 if on_gpu else 5)
    console.print(f"[bold]pagedmlx doctor[/]  backend {backend_name()}, device {selector.device_name() or '?'}, "
                  f"mlx {mx.__version__}, {platform.platform()}")
    checks = Table("check", "result", title="paged kernels (compiled and checked against the gather path)")
    ok = True
    if backend is None:
        checks.add_row("paged kernels", "not used: no GPU backend (decode gathers pages)")
    else:
        h, kv = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
        d = MODEL["hidden_size"] // h
        shapes = [(h, kv, d, dt) for dt in (mx.float16, mx.bfloat16, mx.float32)] + [(28, 4, 128, dtype)]
        for name, passed, detail in check.run_checks(backend, shapes, args.block_size, True,
                                                     windows=(None, 100), sinks=(False, True)):
            ok &= passed
            checks.add_row(name, "[green]passed[/]" if passed else f"[red]failed[/]: {detail}")
        for name, passed, detail in _quantized_checks(backend, h, kv, d, args.block_size):
            ok &= passed
            checks.add_row(name, "[green]passed[/]" if passed else f"[red]failed[/]: {detail}")
    console.print(checks)
    for name in args.model or [None]:
        table, loaded = kernel_paths_table(name, args, dtype)
        console.print(table)
        ok &= loaded
    if args.no_timing:
        return 0 if ok else 1
    console.print(_timing_table(args, dtype, backend is not None, console))
    return 0 if ok else 1


def _quantized_checks(backend: str, h: int, kv: int, d: int, block_size: int):
    """The quantized decode kernel (kv_cache_dtype int8 / int4 at their default groups) against the gather path."""
    import mlx.core as mx

    from pagedmlx.kernels import check
    from pagedmlx.core.kv.cache_dtype import layer_quant

    for dtype in ("int8", "int4"):
        q = layer_quant(dtype, None, d, d)
        for window, sinks in ((None, False), (100, True)):
            name = (f"decode {dtype}/{q.group_size} H={h} kv={kv} D={d} bfloat16"
                    + (" window=100 sinks" if sinks else ""))
            yield (name, *check._guarded(check.check_decode_quantized, backend, h, kv, d, mx.bfloat16, q, block_size,
                                         window, sinks))


def kernel_paths_table(name, args: argparse.Namespace, dtype):
    """Which kernel each KV cache group's layers run here, for the model `name` (None: the timing
    table's random Llama in `dtype`), after the engine's own load-time checks; and whether the model
    loaded (a model that does not load is the table's one row)."""
    from rich.markup import escape
    from rich.table import Table

    from pagedmlx.config import EngineConfig
    from pagedmlx.runner.kernel_paths import kernel_path_lines
    from pagedmlx.runner.model import ModelRunner, UnsupportedModelError

    if name is None:
        from mlx_lm.models import llama

        model = llama.Model(llama.ModelArgs.from_dict(MODEL))
        model.set_dtype(dtype)
        title = f"random {MODEL['num_hidden_layers']}-layer llama, {args.dtype}"
    else:
        from pagedmlx.loaders.loader import load_model

        try:
            model, title = load_model(name, dtype=args.dtype)[0], name
        except Exception as exc:  # noqa: BLE001 - a model that does not load is a row of the report, not a traceback
            table = Table("model", "result", title=f"which kernel each layer runs: {escape(name)}")
            table.add_row(escape(name), f"[red]could not load[/]: {escape(f'{type(exc).__name__}: {exc}')}")
            return table, False
    table = Table("KV cache group", "kernels (a portable path's reason in parentheses)",
                  title=f"which kernel each layer runs: {escape(title)}")
    try:
        runner = ModelRunner(model, EngineConfig(block_size=args.block_size, num_blocks=64,
                                                 kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto")))
    except UnsupportedModelError as exc:
        table.add_row("-", f"[red]refused[/]: {escape(str(exc))}")
        return table, True
    for line in kernel_path_lines(runner):
        group, _, paths = line.partition(": ")
        table.add_row(escape(group), escape(paths))
    bs = runner.kv_cache_config.block_size
    table.add_row("pages", ", ".join(f"{g.name}: {g.page_size_bytes // bs:,} B/token of {g.kv_cache_dtype} pages"
                                     for g in runner.kv_cache_config.kv_cache_groups if not g.is_state))
    return table, True


def _timing_table(args: argparse.Namespace, dtype, kernels: bool, console):
    from rich.table import Table

    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(MODEL))
    model.set_dtype(dtype)
    table = Table("batch", "paged, kernels on", "paged, kernels off", "mlx-lm BatchGenerator", "speed-up, kernels on",
                  title=f"decode step, ms (median of {args.steps}), {args.context}-token context, random "
                        f"{MODEL['num_hidden_layers']}-layer llama (head_dim 128, GQA 4), {args.dtype}")
    for batch in args.batch_sizes:
        console.print(f"[dim]timing batch {batch} x {args.context} tokens: paged steps, then mlx-lm's...[/]")
        on, off = _paged_step_ms(model, batch, args, kernels)
        ref = _batch_generator_step_ms(model, batch, args)
        table.add_row(str(batch), f"{on:.2f}" if kernels else "-", f"{off:.2f}", f"{ref:.2f}",
                      f"{ref / on:.2f}x" if kernels else "-")
    return table


def _paged_step_ms(model, batch: int, args: argparse.Namespace, kernels: bool) -> tuple[float, float]:
    """A decode step of `batch` sequences of args.context tokens, pages filled at random (no
    prefill: attention's cost does not depend on the values), kernels on and then off."""
    import mlx.core as mx

    from pagedmlx.config import EngineConfig
    from pagedmlx.kernels.selector import KernelPlan
    from pagedmlx.runner.model import ModelRunner
    from pagedmlx.core.sched.output import decode_only_output

    bs, ctx = args.block_size, args.context
    per_seq = -(-ctx // bs)
    runner = ModelRunner(model, EngineConfig(block_size=bs, num_blocks=batch * per_seq + 1), verify=False)
    pool = runner.kv_pool
    for i in range(len(pool.keys)):  # a plain Llama: every layer owns pages
        pool.keys[i] = mx.random.normal(pool.keys[i].shape).astype(pool.keys[i].dtype)
        pool.values[i] = mx.random.normal(pool.values[i].shape).astype(pool.values[i].dtype)
    mx.eval(pool.keys, pool.values)
    so = decode_only_output(batch, ctx, bs)
    times = []
    for plan in ([runner.kernels] if kernels else []) + [KernelPlan(runner.kernels.backend, reason="doctor")]:
        runner.kernels = plan
        samples = []
        for i in range(args.steps + 2):  # two warm-up steps (kernel builds)
            t = time.perf_counter()
            mx.eval(runner.forward(so))
            if i >= 2:
                samples.append(time.perf_counter() - t)
        times.append(1e3 * statistics.median(samples))
    return (times[0], times[-1]) if kernels else (float("nan"), times[0])


def _batch_generator_step_ms(model, batch: int, args: argparse.Namespace) -> float:
    """mlx-lm's BatchGenerator, `batch` prompts of args.context - 1 tokens: the median time of its
    decode steps once every prompt is in (after two warm-up steps, as on the paged side; a mean
    would count the one-off graph builds of MLX's CUDA attention)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=args.steps + 4, completion_batch_size=batch,
                         prefill_batch_size=min(batch, 8))
    gen.insert([[1] * (args.context - 1) for _ in range(batch)], max_tokens=[args.steps + 4] * batch)
    started, samples = set(), []
    while len(samples) < args.steps + 2:
        t = time.perf_counter()
        responses = gen.next_generated()
        if not responses:
            break
        if len(started) == batch:
            samples.append(time.perf_counter() - t)
        started.update(r.uid for r in responses)
    gen.close()
    return 1e3 * statistics.median(samples[2:] or samples or [float("nan")])
