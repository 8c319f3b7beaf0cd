"""LoRAModelManager (vLLM's LRUCacheLoRAModelManager and WorkerLoRAManager in one): the adapters the
engine core has read (a host cache of max_cpu_loras, least recently used dropped first, each read
again from its folder when needed), the max_loras device slots their weights are stacked in, and
each step's row-to-slot map.

The scheduler admits at most max_loras distinct adapters among running requests, so a step never
needs more slots than there are. A step's adapters take the slots they hold, or the least recently
used slots no adapter of the step holds. A layer is wrapped (layers.py: LinearWithLoRA) the first
time an adapter that targets it takes a slot, and keeps its stacks: a slot an adapter leaves is
zeroed in every layer it filled."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pagedmlx.lora.layers import LinearWithLoRA, LoRAStep, PunicaWrapper
from pagedmlx.lora.models import LoRAError, LoRAModel
from pagedmlx.lora.request import LoRARequest
from pagedmlx.layers.merged_linear import separate


@dataclass
class StepLoRA:
    """A step's adapter rows on the host, before the upload."""

    host: dict[str, np.ndarray]  # lora_indices (T,), lora_used (k,), lora_used_columns (k * max_rank,)
    slots: frozenset
    dora_slots: frozenset


class LoRAModelManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: Optional[int] = None,
                 in_use: Callable[[], set[int]] = set, kernel_backend: Optional[str] = None,
                 kernel_reason: Optional[str] = None):
        """in_use: the adapter ids unfinished requests hold (the engine core's); kernel_backend: where
        kernels/lora.py runs the LoRA rows (selector.select_lora_kernel), None: MLX's products, for
        kernel_reason."""
        self.model = model
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.capacity = max(max_cpu_loras or max_loras, max_loras)
        self.in_use = in_use
        self.punica = PunicaWrapper(kernel_backend)
        self.kernel_reason = kernel_reason
        self.num_slots = max_loras + 1  # slot 0: rows without an adapter
        self._cache: OrderedDict[int, LoRAModel] = OrderedDict()  # host copies, least recently used first
        self._requests: dict[int, LoRARequest] = {}  # every adapter added and not removed: read again from its folder
        self._removed: set[int] = set()  # removed while requests still ran with them
        self._slot_of: dict[int, int] = {}
        self._slot_ids: list[Optional[int]] = [None] * self.num_slots
        self._slot_lru: list[int] = list(range(1, self.num_slots))  # least recently used first
        self._slot_scales = np.zeros(self.num_slots, np.float32)
        self._slot_dora = np.zeros(self.num_slots, bool)
        self._slot_scales_dev = mx.array(self._slot_scales)
        self._slot_dora_dev = mx.array(self._slot_dora)
        self.generation = 0  # changes whenever a slot's weights do: a compiled step's trace holds them
        self.layers: dict[str, LinearWithLoRA] = {}  # wrapped so far, by path

    # ---- adapters in and out ------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> bool:
        """Read and check the adapter (LoRAError saying why it cannot be served); False if it was
        already loaded. An id names one adapter: the same id with another name or folder is refused."""
        self._forget_removed()
        lid = request.lora_int_id
        known = self._requests.get(lid)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise LoRAError(f"adapter {request.lora_name!r}: lora_int_id {lid} already names adapter "
                            f"{known.lora_name!r} ({known.lora_path}); every adapter needs its own id")
        self._removed.discard(lid)
        if lid in self._cache:
            self._cache.move_to_end(lid)
            return False
        lora = LoRAModel.from_local_checkpoint(request, self.model, self.max_lora_rank)
        self._requests[lid] = request
        self._cache[lid] = lora
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return known is None

    def remove_adapter(self, lora_id: int) -> bool:
        """Forget an adapter; requests still running with it finish with it first."""
        if lora_id not in self._requests or lora_id in self._removed:
            return False
        self._removed.add(lora_id)
        self._forget_removed()
        return True

    def list_adapters(self) -> set[int]:
        return set(self._requests) - self._removed

    def get_adapter(self, lora_id: int) -> Optional[LoRARequest]:
        return self._requests.get(lora_id)

    def _forget_removed(self) -> None:
        if not self._removed:
            return
        for lid in self._removed - self.in_use():
            self._removed.discard(lid)
            self._requests.pop(lid, None)
            self._cache.pop(lid, None)
            slot = self._slot_of.pop(lid, None)
            if slot is not None:
                self._clear_slot(slot)

    # ---- slots --------------------------------------------------------------------------------

    def prepare_step(self, lora_int_ids: np.ndarray, num_scheduled_tokens: list[int]) -> Optional[StepLoRA]:
        """The step's adapters into slots, and each row's slot; None when no row has an adapter."""
        if not len(lora_int_ids) or not lora_int_ids.any():
            return None
        wanted = set(np.unique(lora_int_ids).tolist()) - {0}
        if len(wanted) > self.max_loras:  # the scheduler never schedules this
            raise RuntimeError(f"a step holds {len(wanted)} adapters but there are {self.max_loras} slots (max_loras)")
        slot_of = {lid: self._activate(lid, wanted) for lid in wanted}
        req_slots = np.array([slot_of.get(int(i), 0) for i in lora_int_ids], np.int32)
        rows = np.repeat(req_slots, num_scheduled_tokens)
        slots = frozenset(slot_of.values())
        used = np.array(sorted(slots), np.int32)
        host = {"lora_indices": rows, "lora_used": used, "lora_used_columns": np.repeat(used, self.max_lora_rank)}
        return StepLoRA(host, slots, frozenset(s for s in slots if self._slot_dora[s]))

    def slot_arrays(self, prepared: StepLoRA) -> dict[str, mx.array]:
        """The slots' scales (and DoRA flags, where the step has DoRA rows) on the device: a compiled
        step's inputs, beside the rows' (step)."""
        out = {"lora_slot_scales": self._slot_scales_dev}
        if prepared.dora_slots:
            out["lora_slot_dora"] = self._slot_dora_dev
        return out

    @contextlib.contextmanager
    def step(self, prepared: StepLoRA, dev: dict[str, mx.array], traced: bool = False) -> Iterator[None]:
        """Every wrapped layer points at the step's uploaded rows while the step's graph is built; traced:
        inside a compiled step's trace, whose dev also holds slot_arrays' (so a replay reads them anew)."""
        dev = {**self.slot_arrays(prepared), **dev}
        self.punica.begin_step(LoRAStep(
            int(prepared.host["lora_indices"].size), dev["lora_indices"], dev["lora_used"], dev["lora_used_columns"],
            prepared.slots, prepared.dora_slots, dev["lora_slot_scales"], dev.get("lora_slot_dora"), traced=traced))
        completed = False
        try:
            yield
            completed = True
        finally:
            self.punica.end_step(completed)

    def _activate(self, lora_id: int, step_ids: set[int]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is None:
            lora = self._cache.get(lora_id)
            if lora is None:  # dropped from the host cache: read again
                request = self._requests.get(lora_id)
                if request is None:
                    raise LoRAError(f"adapter id {lora_id} is not loaded")
                self.add_adapter(request)
                lora = self._cache[lora_id]
            slot = next(s for s in self._slot_lru if self._slot_ids[s] not in step_ids)
            self._load_slot(slot, lora)
        self._slot_lru.remove(slot)
        self._slot_lru.append(slot)
        if lora_id in self._cache:
            self._cache.move_to_end(lora_id)
        return slot

    def _load_slot(self, slot: int, lora: LoRAModel) -> None:
        if self._slot_ids[slot] is not None:
            del self._slot_of[self._slot_ids[slot]]
        pending = [a for path, layer in self.layers.items() if path not in lora.loras for a in layer.reset_lora(slot)]
        for path, weights in lora.loras.items():
            layer = self.layers.get(path) or self._wrap(path, weights.lora_a.dtype)
            pending += layer.set_lora(slot, weights)
        self._slot_ids[slot], self._slot_of[lora.id] = lora.id, slot
        self._set_slot_info(slot, lora.scale, lora.is_dora)
        mx.eval(pending)

    def _clear_slot(self, slot: int) -> None:
        pending = [a for layer in self.layers.values() for a in layer.reset_lora(slot)]
        self._slot_ids[slot] = None
        self._set_slot_info(slot, 0.0, False)
        mx.eval(pending)

    def _set_slot_info(self, slot: int, scale: float, dora: bool) -> None:
        self.generation += 1
        self._slot_scales[slot], self._slot_dora[slot] = scale, dora
        self._slot_scales_dev, self._slot_dora_dev = mx.array(self._slot_scales), mx.array(self._slot_dora)

    def _wrap(self, path: str, adapter_dtype: mx.Dtype) -> LinearWithLoRA:
        """Put a LinearWithLoRA in the model's tree where the layer at `path` is."""
        *parents, last = path.split(".")
        parent = self.model
        for part in parents:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        base = parent[int(last)] if isinstance(parent, list) else parent[last]
        weights = separate(base)  # a merged projection's own rows (layers/merged_linear.py)
        base_dtype = weights.scales.dtype if isinstance(weights, nn.QuantizedLinear) else weights.weight.dtype
        layer = LinearWithLoRA(base, self.punica, self.num_slots, self.max_lora_rank,
                               mx.result_type(adapter_dtype, base_dtype))
        if isinstance(parent, list):
            parent[int(last)] = layer
        else:
            setattr(parent, last, layer)
        self.layers[path] = layer
        self.punica.forget_siblings()
        return layer
