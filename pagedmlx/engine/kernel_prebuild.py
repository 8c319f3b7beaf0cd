"""A first start's kernel builds, run beside the weights' read (CUDA).

A first start on a machine compiles dozens of kernels (pagedmlx's through NVRTC, MLX's own through its JIT) while
the engine's load-time checks and warm-up run. What they compile depends on the model's widths and the engine's
settings, not on its depth or its weights' values; reading the weights of an 8B model takes about as long (28-34 s
on an H100 machine) and leaves the GPU idle. So `start` runs, in a process of its own, the same engine on the same
folder cut to its first few layers (a few GB read instead of all of it, a small KV pool): what it compiles lands in
the disk caches (kernels/disk_cache.py, MLX's PTX cache), and the real engine, built once its weights are in and the
child has exited, finds it there. The child's checks are not kept (its weights are not the model's).

A marker under the cache folder, keyed by the model's config, the engine's settings, the environment's switches and
the versions, says that a start already built them: later starts run no child. Nothing here is needed for
correctness: a child that fails, or is skipped, leaves the builds to the engine, as before. Off unless
PAGEDMLX_PREBUILD=1, until a GPU has timed it.

    python -m pagedmlx.engine.prebuild_child ARGS_PICKLE MARKER     # the child (prebuild_child.py)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from pagedmlx import envs
from pagedmlx.config import EngineConfig
from pagedmlx.kernels.compile_workers import child_env

logger = logging.getLogger("pagedmlx")

MIN_DEPTH = 4  # layers the child keeps at least: more where the config's layer pattern is longer (shallow_overrides)
CHILD_KV_GB = 2.0  # the child's KV pool
CHILD_BYTES = 6 * 2**30  # the child's pool, a step's activations and its CUDA context, beyond its weights
CHILD = "pagedmlx.engine.prebuild_child"  # the module the child runs (named, not imported: it imports the engine)
TIMEOUT_S = 600  # a child still running after this is stopped; the engine builds what it did not
# Config keys whose integer value is a layer pattern's period (the child keeps one whole period).
_PERIODS = ("sliding_window_pattern", "full_attention_interval", "interleave_moe_layer_step", "decoder_sparse_step")


def shallow_overrides(config: dict[str, Any]) -> Optional[dict[str, Any]]:
    """mlx-lm model_config overrides that cut a model's config.json to its first layers, with every layer kind of
    its pattern kept (a period of sliding and full attention, the first MoE layer past the dense ones, each of
    `layer_types`); None where the config names no layer count, is already that shallow, or has per-layer inputs
    (their weights' shapes follow the layer count: a cut model could not read them)."""
    nested = isinstance(config.get("text_config"), dict) and "num_hidden_layers" in config["text_config"]
    text = config["text_config"] if nested else config
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or text.get("hidden_size_per_layer_input"):
        return None  # no layer count; or per-layer inputs (Gemma 3n/4 "E"), whose embedding is as wide as the layers
    depth = MIN_DEPTH
    for key in _PERIODS:
        if isinstance(text.get(key), int):
            depth = max(depth, text[key])
    if isinstance(text.get("first_k_dense_replace"), int):
        depth = max(depth, text["first_k_dense_replace"] + 1)
    types = text.get("layer_types")
    if isinstance(types, list) and all(isinstance(t, str) for t in types):
        depth = max([depth] + [1 + types.index(t) for t in set(types)])
    if depth >= n:
        return None
    changes: dict[str, Any] = {"num_hidden_layers": depth}
    if isinstance(types, list):
        changes["layer_types"] = types[:depth]
    if isinstance(text.get("num_kv_shared_layers"), int):  # layers reading an earlier layer's KV: none in the cut
        changes["num_kv_shared_layers"] = 0
    return {"text_config": {**text, **changes}} if nested else changes


def child_config(config: EngineConfig, folder: Path) -> EngineConfig:
    """The child's engine settings: the parent's, on the folder, with a small KV pool and nothing else to read."""
    return replace(config, model=str(folder), kv_cache_memory_gb=CHILD_KV_GB, num_blocks=None,
                   speculative_config=None, enable_lora=False)


def marker_key(config: EngineConfig, folder: Path) -> str:
    """What a start's builds depend on: the model's config, the engine's settings, the environment's switches
    (not its keys) and the versions of MLX, mlx-lm, pagedmlx and the device."""
    import mlx.core as mx
    import mlx_lm

    from pagedmlx import __version__
    from pagedmlx.platform import device_name

    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith(("PAGEDMLX_", "MLX_"))
                      and not k.endswith("_KEY"))
    text = json.dumps([(folder / "config.json").read_text(), repr(child_config(config, folder)), switches,
                       mx.__version__, mlx_lm.__version__, __version__, device_name()])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class Prebuild:
    """A running child; `wait` once the weights are read."""

    proc: subprocess.Popen
    marker: Path
    log: Path
    started: float

    def wait(self) -> None:
        """Until the child exits (stopped after TIMEOUT_S); says how it went."""
        left = TIMEOUT_S - (time.monotonic() - self.started)
        if self.proc.poll() is None:
            logger.info("waiting for the kernels' prebuild (started %.0f s ago)", time.monotonic() - self.started)
        try:
            code = self.proc.wait(timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        took = time.monotonic() - self.started
        if code == 0:
            logger.info("kernels prebuilt beside the weights' read in %.1f s (a shallow copy of the model in a "
                        "process of its own)", took)
        else:
            logger.warning("the kernels' prebuild %s after %.1f s; the engine builds them (its log: %s)",
                           "was stopped" if code is None else f"failed (exit {code})", took, self.log)


def start(config: EngineConfig, on_cuda: Optional[bool] = None) -> Optional[Prebuild]:
    """A child building the engine's kernels for config.model, or None where it would not help: off CUDA or without
    its disk cache (on_cuda=None: this process's backend), PAGEDMLX_PREBUILD not 1, not an mlx-lm folder, a config it
    cannot cut, built before (its marker), or too little free device memory for it beside the whole model."""
    from pagedmlx.loaders.loader import weights_path
    from pagedmlx.platform import backend_name, cache_dir

    if on_cuda is None:
        on_cuda = backend_name() == "CUDA" and bool(envs.MLX_PTX_CACHE_DIR)
    if not on_cuda or not envs.PAGEDMLX_PREBUILD or not config.model:
        return None
    folder = weights_path(config.model)
    if folder is None or not folder.is_dir() or not (folder / "config.json").is_file():
        return None
    overrides = shallow_overrides(json.loads((folder / "config.json").read_text()))
    if overrides is None:
        return None
    marker = cache_dir() / "prebuilt" / marker_key(config, folder)
    if marker.exists() or not _fits(folder):
        return None
    marker.parent.mkdir(parents=True, exist_ok=True)
    args = marker.with_suffix(".args")
    args.write_bytes(pickle.dumps((child_config(config, folder), overrides)))
    log = marker.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", CHILD, str(args), str(marker)],
                                stdout=out, stderr=subprocess.STDOUT, env=child_env())
    logger.info("building kernels in a process of its own while the weights are read (a %d-layer copy)",
                overrides.get("text_config", overrides)["num_hidden_layers"])
    return Prebuild(proc, marker, log, time.monotonic())


def _fits(folder: Path) -> bool:
    """Whether the device's free memory holds the whole model and the child at once (twice the weights, a bound on
    the child's share of them, and CHILD_BYTES); True where MLX does not say what is free."""
    from pagedmlx.runner.kv_budget import free_device_bytes

    free = free_device_bytes(True)
    if free is None:
        return True
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return free >= 2 * weights + CHILD_BYTES
