"""Which kernel each layer runs, said out loud: per KV cache group (one layer kind), the path of its
decode rows, its prefill rows and its page write, or for the recurrent-state group its update; and,
wherever a portable path runs, why (the KernelPlan's reason: no GPU backend, a switch, a load-time
check that failed; or a head shape the kernel does not take). The same gates the step uses decide
(decode_attention.supports_layer, the runner's prefill_heads, the plan), so the text cannot drift
from what runs. `pagedmlx doctor` prints these lines for a model; the server prints them at start
(engine/core_info.py)."""

from __future__ import annotations

from typing import Any, Optional

from pagedmlx.config import EngineConfig
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.kernels import decode_attention, decode_attention_quant, disk_cache, fused_moe, prefill_attention
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.kernels.selector import KernelPlan, select_kernels, select_quantized
from pagedmlx.layers import quantized_linear, skinny_linear

PORTABLE = "gather + SDPA"  # pages gathered into a contiguous copy, then MLX's attention


def select_kernel_plan(plan: list, kv_quant: dict[int, KVQuant], windows: list[Optional[int]], block_size: int,
                       config: EngineConfig) -> KernelPlan:
    """The paged kernels these planned layers run here (kernels/selector.py), checked at their shapes, windows and
    sinks; on CUDA the checks' kernel variants are compiled at once first (a dry pass names them:
    disk_cache.prebuild_met), not one by one as the checks meet them."""
    owners = [p for p in plan if p.has_pages]
    attending = [p for p in plan if p.has_pages or p.kind == "shared"]
    window_set, sinks = tuple(sorted(set(windows), key=str)), tuple(sorted({p.sinks for p in attending}))

    def select() -> KernelPlan:
        kernels = select_kernels([p.spec for p in owners], [p.n_heads for p in owners], block_size,
                                 windows=window_set, sinks=sinks, state_layers=any(p.state is not None for p in plan),
                                 prefill=config.prefill_kernel is not False, quantized=bool(kv_quant))
        if kv_quant:  # the quantized decode kernel where it takes the layers and passes its check
            kernels = select_quantized(kernels, [(p.spec, p.n_heads, kv_quant[i]) for i, p in enumerate(plan)
                                                 if i in kv_quant], block_size, config.kv_cache_dtype,
                                       windows=window_set, sinks=sinks)
        return kernels

    disk_cache.prebuild_met(select)
    return select()


def layer_list(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _shape(spec: tuple, n_heads: int) -> str:
    n_kv, dk, dv, dt = spec
    return f"H={n_heads} kv={n_kv} D={dk}{'' if dk == dv else f'/{dv}'} {str(dt).split('.')[-1]}"


def kernel_path_lines(runner: Any) -> list[str]:
    """One line per KV cache group of a ModelRunner: "<group> (layers ...): decode ...; prefill ...;
    page write ..." or, for the state group, "state (layers ...): update ...", each portable path
    followed by its reason in parentheses (once at the end when they all share it)."""
    plan, kernels = runner.plan, runner.kernels
    paged = [g for g in runner.kv_cache_config.kv_cache_groups if not g.is_state]
    lines = []
    for gi, group in enumerate(paged):
        ids = set(group.layer_ids)
        shared = [i for i, p in enumerate(plan) if p.kind == "shared" and p.source in ids]
        shapes: dict[tuple, list[int]] = {}  # (spec, query heads) -> the layers reading the pages with it
        for i in sorted(ids | set(shared)):
            p = plan[i]
            shapes.setdefault((plan[p.source].spec if p.kind == "shared" else p.spec, p.n_heads), []).append(i)
        layers = _layers(sorted(ids)) + (f", KV shared by {_layers(shared)}" if shared else "")
        quant = getattr(runner, "kv_quant", {})
        quant = {**quant, **{i: quant[plan[i].source] for i in shared if plan[i].source in quant}}
        group_quant = next((quant[i] for i in sorted(ids) if i in quant), None)
        paths = [*_decode_paths(kernels, shapes, quant),
                 _prefill_path(kernels, shapes, runner.prefill_heads[gi], group_quant),
                 _write_path(kernels, group_quant is not None)]
        lines.append(f"{group.name} ({layers}): {_join(paths)}")
    state = next((g for g in runner.kv_cache_config.kv_cache_groups if g.is_state), None)
    if state is not None:
        lines.append(f"{state.name} ({_layers(list(state.layer_ids))}): {_join([_state_path(kernels)])}")
    if getattr(runner, "merges", False):
        lines.append(f"projections: {runner.merged_groups} groups each one matmul (layers/merged_linear.py)")
    if getattr(runner, "fused_norms", False):
        lines.append("residual adds: fused with the RMSNorms after them (layers/fused_residual.py)")
    if getattr(runner, "skinny", False):
        rows = skinny_linear.rows_taken()
        lines.append(f"products of {rows[0]}-{rows[-1]} rows: skinny GEMM kernel (layers/skinny_linear.py)")
    if getattr(runner, "quantized_gemm", False):
        rows = quantized_linear.QUANTIZED_GEMM_ROWS
        lines.append(f"quantized products of {rows[0]}-{rows[-1]} rows: quantized GEMM kernel "
                     "(layers/quantized_linear.py)")
    if getattr(runner, "fused_moe", 0):
        fewest = fused_moe.min_tokens()
        lines.append(f"MoE experts: fused MoE kernel in {runner.fused_moe} layers"
                     + (f" for steps of {fewest}+ tokens, gather_qmm below" if fewest > 1 else "")
                     + " (layers/fused_moe.py)")
    lora = getattr(runner, "lora_manager", None)
    if lora is not None:
        lines.append("LoRA adapters: " + (f"batched LoRA kernel on {lora.punica.kernel_backend} (DoRA rows: MLX's "
                                          "products)" if lora.punica.kernel_backend is not None else
                                          f"MLX's stacked products ({lora.kernel_reason or 'kernels off'})"))
    return lines


def _layers(ids: list[int]) -> str:
    return f"layer{'s' if len(ids) > 1 else ''} {layer_list(ids)}"


def _join(paths: list[tuple[str, Optional[str]]]) -> str:
    """(path, why it is not a kernel or None) -> "a (why); b" or, all for one reason, "a; b (why)"."""
    whys = {why for _, why in paths}
    if len(whys) == 1 and None not in whys:
        return "; ".join(path for path, _ in paths) + f" ({whys.pop()})"
    return "; ".join(path + (f" ({why})" if why else "") for path, why in paths)


def _decode_paths(kernels: Any, shapes: dict, quant: dict) -> list[tuple[str, Optional[str]]]:
    """quant: the quantized layers' KVQuant, by layer (runner.kv_quant)."""
    paths = []
    for (spec, h), layers in shapes.items():
        n_kv, dk, dv, dt = spec
        q = next((quant[i] for i in layers if i in quant), None)
        why = None if kernels.decode else kernels.reason
        if why is None and kernels.backend is not None:  # the gate each layer call passes (attention.py)
            why = (decode_attention.layer_refusal(dk, dv, h, n_kv, dt, kernels.backend) if q is None else
                   decode_attention_quant.refusal(dk, dv, h, n_kv, dt, q, kernels.backend))
        mma = False
        if why is None and kernels.decode:
            mma = (decode_attention.uses_tensor_cores(dk, h // n_kv, dt, kernels.backend) if q is None else
                   decode_attention_quant.uses_tensor_cores(dk, h // n_kv, dt, q, kernels.backend))
            path = "paged decode kernel"
        else:
            path, why = PORTABLE, why or "kernels off"
        if q is not None:
            path += f" over int{q.bits} pages (group {q.group_size})"
        if mma:
            path += " on tensor cores"
        paths.append((f"decode {path}" if len(shapes) == 1 else f"decode {_shape(spec, h)} {path}", why))
    return paths


def _prefill_path(kernels: Any, shapes: dict, heads: Optional[tuple[int, int]],
                  quant: Any = None) -> tuple[str, Optional[str]]:
    if heads is not None:  # runner.prefill_heads: the group's prefill rows go through the kernel
        over = f" over int{quant.bits} pages (group {quant.group_size})" if quant is not None else ""
        return (f"prefill paged prefill kernel{over} (steps whose chunks are all <= "
                f"{prefill_attention.PREFILL_KERNEL_MAX_QUERY} tokens; longer: {PORTABLE})", None)
    if not kernels.prefill:
        why = kernels.prefill_reason or kernels.reason
    elif len({(spec[0], h // spec[0]) for spec, h in shapes}) > 1:
        why = "its layers differ in KV heads or query heads per KV head"
    else:
        why = next((r for (n_kv, dk, dv, dt), h in shapes
                    if (r := prefill_attention.prefill_refusal(dk, dv, h, n_kv, dt))), None)
    return f"prefill {PORTABLE}", why or "kernels off"


def _write_path(kernels: Any, quantized: bool = False) -> tuple[str, Optional[str]]:
    if kernels.page_write and quantized and getattr(kernels, "quantize_in_write", False):
        return "page write kernel, in place, quantizing the rows", None
    if kernels.page_write and quantized:
        return "page write kernel, in place, after mx.quantize", getattr(kernels, "quantizing_reason", None)
    if kernels.page_write:
        return "page write kernel, in place", None
    if getattr(kernels, "page_write_reason", None):  # its load-time check failed
        return "page write MLX scatter", kernels.page_write_reason
    if kernels.reason is None and kernels.backend is not None:
        return "page write MLX scatter", f"not in place on {kernels.backend} yet"
    return "page write MLX scatter", kernels.reason or "kernels off"


def _state_path(kernels: Any) -> tuple[str, Optional[str]]:
    if kernels.state:
        return "update recurrent-state kernels (gated delta rule, short convolution; states written in place)", None
    why = "the state kernels are CUDA only" if kernels.backend not in (None, CUDA) else kernels.reason
    return "update mlx-lm's own code, states scattered into the pool", why or "kernels off"
