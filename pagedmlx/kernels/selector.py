"""Which kernels a process may use (its KernelPlan), decided at load and never on trust alone.

On Metal (which no machine of the project has run) and on any CUDA GPU other than the one the GPU
suite runs on, the kernels are compiled and checked first (check.py), with the model's own head
shapes and dtypes, against the gather path: decode rows at lengths that cross block and split
boundaries, split and unsplit, the page write and a read of its pages in the same graph. A kernel
that fails to compile, fails to run or disagrees is switched off with one warning line naming the
reason, and decode attention gathers pages instead (the path every backend has).
PAGEDMLX_METAL_KERNELS=0 (or PAGEDMLX_CUDA_KERNELS=0) switches them off.

The plan also says whether the recurrent-state kernels (recurrent_state.py, CUDA only) run: they are
checked with the whole model, by the runner's load-time check (runner/selfcheck.py), which switches
the plan off if the model disagrees with mlx-lm.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.kernels import (add_rms_norm, build, check, decode_attention, decode_attention_quant, disk_cache, lora,
                              prefill_attention)
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.platform import device_name
from pagedmlx.runner import check_cache

logger = logging.getLogger("pagedmlx")

# GPUs the project's GPU suite has run the kernels on: checked there, not at load.
TRUSTED_GPUS = {CUDA: ("H200",)}
# Pages written in place by the page-write kernel. Not on Metal yet: the engine then dispatches step
# N+1 before step N ends, and nothing run here shows that Metal keeps one step's page reads before
# the next step's writes (CUDA's single stream does); MLX's scatter writes them there instead.
PAGES_IN_PLACE = {CUDA: True}


@dataclass
class KernelPlan:
    backend: Optional[str]
    decode: bool = False  # decode rows read pages through the paged-decode kernel
    page_write: bool = False  # the page-write kernel writes new K/V in place
    quantize_in_write: bool = False  # quantized pages: that kernel quantizes the rows itself (no mx.quantize)
    state: bool = False  # the recurrent-state kernels run in state layers (and write the state pool in place)
    prefill: bool = False  # prefill rows of the layers it takes attend through the paged prefill kernel
    checks: list[tuple[str, str]] = field(default_factory=list)  # (check, "passed" | "trusted" | "failed: ...")
    reason: Optional[str] = None  # why the paged kernels are off
    prefill_reason: Optional[str] = None  # why the prefill kernel is off while the others run
    page_write_reason: Optional[str] = None  # why the page write is not in place while the others run
    quantizing_reason: Optional[str] = None  # why the in-place write of quantized pages does not quantize itself

    @property
    def paged(self) -> bool:
        return self.decode or self.page_write

    @property
    def enabled(self) -> bool:
        """Any kernel runs: the paged ones (the prefill kernel alone too: quantized pages whose decode kernel is
        off), or the state kernels."""
        return self.paged or self.prefill or self.state

    def switch_off(self, reason: str, keep_state: bool = False) -> "KernelPlan":
        """The paged kernels (prefill included) off, and the state kernels too unless keep_state."""
        if self.paged or self.prefill:
            logger.warning("pagedmlx: %s paged kernels off: %s; attention reads pages through the portable path",
                           self.backend, reason)
        if self.state and not keep_state:
            logger.warning("pagedmlx: recurrent-state CUDA kernels off: %s; mlx-lm's own state code runs instead",
                           reason)
        return KernelPlan(self.backend, state=self.state and keep_state, checks=self.checks, reason=reason)


def select_kernels(layer_specs: list[tuple[int, int, int, mx.Dtype]], query_heads: list[int], block_size: int,
                   windows: tuple[Optional[int], ...] = (None,), sinks: tuple[bool, ...] = (False,),
                   state_layers: bool = False, prefill: bool = True, quantized: bool = False) -> KernelPlan:
    """The kernels this model may use here. layer_specs: (kv heads, Dk, Dv, dtype) per layer;
    windows / sinks: the windows and with / without sinks that the model's layers use, so that the
    check covers them (and only them); state_layers: the model has recurrent-state layers;
    prefill: the paged prefill kernel may run (CUDA) for the layers it takes; quantized: the pages are
    quantized, so the 16-bit kernels are not checked (select_quantized then checks its own)."""
    backend = build.gpu_backend()
    if backend is None:
        return KernelPlan(None, reason="no GPU backend")
    env = f"PAGEDMLX_{backend.upper()}_KERNELS"
    if not getattr(envs, env):
        return KernelPlan(backend, reason=f"{env}=0")
    shapes = kernel_shapes(layer_specs, query_heads, backend)
    prefill_shapes = [x for x in shapes if prefill_attention.supports_prefill(x[2], x[2], x[0], x[1], x[3])]
    plan = KernelPlan(backend, decode=bool(shapes), page_write=PAGES_IN_PLACE.get(backend, False),
                      state=state_layers and backend == CUDA,
                      prefill=prefill and backend == CUDA and bool(prefill_shapes))
    if not plan.prefill:
        plan.prefill_reason = ("--no-prefill-kernel" if not prefill else "the prefill kernel is CUDA only"
                               if backend != CUDA else "no layer shape the prefill kernel takes")
    if not plan.paged:
        return KernelPlan(backend, state=plan.state, reason="no layer shape the decode kernel takes")
    name = device_name()
    if quantized:
        return plan
    if any(gpu in name for gpu in TRUSTED_GPUS.get(backend, ())):
        plan.checks.append((f"{name}: checked by tests/test_gpu_kernels.py", "trusted"))
        return plan
    checked = prefill_shapes if plan.prefill else []
    key = _check_key("paged kernels", backend, shapes, block_size, plan.page_write, windows, sinks, checked)
    replay = check_cache.passed(key)  # the same checks, counted as passed unrun: the same plan as then
    with check.passed_before() if replay else contextlib.nullcontext():
        for label, ok, detail in check.run_checks(backend, shapes, block_size, plan.page_write, windows, sinks,
                                                  checked):
            plan.checks.append((label, "passed" if ok else f"failed: {detail}"))
            if not ok:
                return plan.switch_off(f"{label}: {detail}", keep_state=True)
    if not replay and not disk_cache.collecting():
        check_cache.record_pass(key)
    return plan


def _check_key(kind: str, backend: str, *parts: object) -> str:
    """The check cache's key of a selector's checks: what they ran on, and the switches that choose the kernels'
    variants (the decode kernel's settings, the quantized pages' tile options)."""
    return check_cache.check_key(kind, decode_attention.SETTINGS.get(backend), envs.PAGEDMLX_QUANT_AFTER,
                                 envs.PAGEDMLX_QUANT_PREFETCH, *parts)


def select_lora_kernel(plan: KernelPlan) -> tuple[Optional[str], Optional[str]]:
    """(the backend where batched LoRA runs kernels/lora.py's kernel, after its check at each load; None
    where MLX's products run the adapters, and then why: no GPU, kernels off by the environment, or a
    failed check)."""
    if plan.backend is None or plan.reason is not None and plan.reason.endswith("_KERNELS=0"):
        return None, plan.reason or "no GPU backend"
    for dtype in (mx.float32, mx.bfloat16):
        try:
            err = lora.check_add_lora(plan.backend, dtype)
        except Exception as exc:  # the kernel failed to build or run
            err = f"did not compile or run ({check.error_line(exc)})"
        if err is not None:
            why = f"its load-time check failed in {str(dtype).split('.')[-1]}: {err}"
            logger.warning("pagedmlx: the batched LoRA kernel is off (%s); MLX's products run the adapters", why)
            return None, why
    return plan.backend, None


def select_norm_kernel(plan: KernelPlan, width: int, dtype: mx.Dtype) -> tuple[Optional[str], Optional[str]]:
    """(the backend where kernels/add_rms_norm.py's kernel fuses residual adds with their RMSNorms, after its
    check at the model's width and dtype at each load; None, and why, where MLX's add and norm run)."""
    if plan.backend is None or plan.reason is not None and plan.reason.endswith("_KERNELS=0"):
        return None, plan.reason or "no GPU backend"
    try:
        err = add_rms_norm.check_add_rms_norm(plan.backend, dtype, dims=(width,))
    except Exception as exc:  # the kernel failed to build or run
        err = f"did not compile or run ({check.error_line(exc)})"
    if err is not None:
        return None, f"the fused add + RMSNorm kernel failed its load-time check: {err}"
    return plan.backend, None


def kernel_shapes(layer_specs: list[tuple[int, int, int, mx.Dtype]], query_heads: list[int],
                  backend: str) -> list[check.Shape]:
    """The distinct (H, n_kv, D, dtype) of layers that the decode kernel takes."""
    shapes = {(h, n_kv, dk, dt) for (n_kv, dk, dv, dt), h in zip(layer_specs, query_heads)
              if h and decode_attention.supports_layer(dk, dv, h, n_kv, dt, backend)}
    return sorted(shapes, key=str)


QuantShape = tuple[int, int, int, mx.Dtype, KVQuant]  # (query heads, kv heads, head_dim, scales' dtype, quant)


def select_quantized(plan: KernelPlan, layers: list[tuple[tuple[int, int, int, mx.Dtype], int, KVQuant]],
                     block_size: int, kv_cache_dtype: str, windows: tuple[Optional[int], ...] = (None,),
                     sinks: tuple[bool, ...] = (False,)) -> KernelPlan:
    """The plan for quantized pages, from the 16-bit plan of the same model: the quantized page write in
    place where the 16-bit one runs (page_write: quantizing the rows itself, or copying mx.quantize's parts);
    the prefill kernel over quantized pages where the 16-bit plan allows the prefill kernel
    (sources/prefill_attention_quant_cuda.py); the quantized decode kernel (decode_attention_quant, on
    tensor cores where CUDA's 16-bit kernel is) for the layers it takes. All are checked here on every GPU
    (no GPU suite has trusted them yet). layers: ((kv heads, Dk, Dv, dtype), query heads, quant) of each
    quantized layer."""
    key = _check_key("quantized paged kernels", plan.backend, plan, layers, block_size, kv_cache_dtype, windows, sinks)
    if check_cache.passed(key):
        with check.passed_before():
            return _select_quantized(plan, layers, block_size, kv_cache_dtype, windows, sinks)
    chosen = _select_quantized(plan, layers, block_size, kv_cache_dtype, windows, sinks)
    if all(result in ("passed", "trusted") for _, result in chosen.checks) and not disk_cache.collecting():
        check_cache.record_pass(key)
    return chosen


def _select_quantized(plan: KernelPlan, layers: list[tuple[tuple[int, int, int, mx.Dtype], int, KVQuant]],
                      block_size: int, kv_cache_dtype: str, windows: tuple[Optional[int], ...],
                      sinks: tuple[bool, ...]) -> KernelPlan:
    checks = list(plan.checks)
    prefill, prefill_why = plan.prefill, plan.prefill_reason
    if prefill:
        prefill_why = _prefill_refusal(plan.backend, layers, block_size, windows, sinks, checks, kv_cache_dtype)
        prefill = prefill_why is None
    page_write = plan.page_write and _page_write_passes(plan.backend, layers, block_size, checks)
    write_why = next((f"{label}: {r}" for label, r in checks if label.startswith("page write int") and r != "passed"),
                     None)
    quantizing = page_write and _page_write_passes(plan.backend, layers, block_size, checks, quantizing=True)
    quantizing_why = next((f"{label}: {r}" for label, r in checks if label.startswith("quantizing page write")
                           and r != "passed"), None)
    off = KernelPlan(plan.backend, page_write=page_write, quantize_in_write=quantizing, state=plan.state, checks=checks,
                     prefill=prefill, prefill_reason=prefill_why, page_write_reason=write_why,
                     quantizing_reason=quantizing_why)
    if not plan.decode:
        off.reason = plan.reason or "no layer shape the decode kernel takes"
        return off
    shapes = sorted({(h, n_kv, dk, dt, q) for (n_kv, dk, dv, dt), h, q in layers
                     if decode_attention_quant.refusal(dk, dv, h, n_kv, dt, q, plan.backend) is None}, key=str)
    if not shapes:
        off.reason = "no layer shape the quantized decode kernel takes"
        return off
    for (h, n_kv, d, dt, q), window, with_sinks in [(x, w, s) for x in shapes for w in windows for s in sinks]:
        label = f"decode int{q.bits}/{q.group_size} H={h} kv={n_kv} D={d}" + (f" window={window}" if window else "") + \
            (" sinks" if with_sinks else "")
        ok, detail = check._guarded(check.check_decode_quantized, plan.backend, h, n_kv, d, dt, q, block_size,
                                    window, with_sinks)
        checks.append((label, "passed" if ok else f"failed: {detail}"))
        if not ok:
            logger.warning("pagedmlx: %s quantized decode kernel off: %s: %s; decode attention gathers pages instead",
                           plan.backend, label, detail)
            off.reason = f"{label}: {detail}"
            return off
    return KernelPlan(plan.backend, decode=True, page_write=page_write, quantize_in_write=quantizing, state=plan.state,
                      checks=checks, prefill=prefill, prefill_reason=prefill_why, page_write_reason=write_why,
                      quantizing_reason=quantizing_why)


def _prefill_refusal(backend: str, layers: list[tuple[tuple[int, int, int, mx.Dtype], int, KVQuant]],
                     block_size: int, windows: tuple, sinks: tuple, checks: list[tuple[str, str]],
                     kv_cache_dtype: str) -> Optional[str]:
    """check.check_prefill over quantized pages for each layer shape the kernel takes, each window and
    sinks; None if all pass, else why the prefill kernel is off (one warning for a failed check)."""
    shapes = sorted({(h, n_kv, dk, dt, q) for (n_kv, dk, dv, dt), h, q in layers
                     if prefill_attention.supports_prefill(dk, dv, h, n_kv, dt, q)}, key=str)
    if not shapes:
        return f"kv_cache_dtype {kv_cache_dtype}: no layer shape the prefill kernel over quantized pages takes"
    for (h, n_kv, d, dt, q), window, with_sinks in [(x, w, s) for x in shapes for w in windows for s in sinks]:
        label = (f"prefill int{q.bits}/{q.group_size} H={h} kv={n_kv} D={d}" + (f" window={window}" if window else "")
                 + (" sinks" if with_sinks else ""))
        ok, detail = check._guarded(check.check_prefill, h, n_kv, d, dt, block_size, window, with_sinks, quant=q)
        checks.append((label, "passed" if ok else f"failed: {detail}"))
        if not ok:
            logger.warning("pagedmlx: %s prefill kernel over quantized pages off: %s: %s; prefill rows gather and "
                           "dequantize the pages instead", backend, label, detail)
            return f"{label}: {detail}"
    return None


def _page_write_passes(backend: str, layers: list[tuple[tuple[int, int, int, mx.Dtype], int, KVQuant]],
                       block_size: int, checks: list[tuple[str, str]], quantizing: bool = False) -> bool:
    """check.check_page_write_quantized for each (kv heads, head_dim, dtype, quant) of the layers; the first
    failure switches that write off with one warning: the in-place write (MLX scatters the quantized rows
    instead), or with quantizing, the write that quantizes itself (mx.quantize runs before the in-place copy)."""
    for n_kv, d, dt, q in sorted({(n_kv, dk, dt, q) for (n_kv, dk, dv, dt), _, q in layers}, key=str):
        label = f"{'quantizing ' if quantizing else ''}page write int{q.bits}/{q.group_size} kv={n_kv} D={d}"
        ok, detail = check._guarded(check.check_page_write_quantized, backend, n_kv, n_kv, d, dt, q, block_size,
                                    quantizing=quantizing)
        checks.append((label, "passed" if ok else f"failed: {detail}"))
        if not ok:
            instead = "mx.quantize runs before the page write" if quantizing else "MLX scatters the pages instead"
            logger.warning("pagedmlx: %s %s off: %s: %s; %s", backend,
                           "quantizing page write" if quantizing else "quantized page write", label, detail, instead)
            return False
    return True
