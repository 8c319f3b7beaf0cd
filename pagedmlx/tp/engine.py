"""Tensor parallelism over mx.distributed: split the model, build rank 0's engine or run a worker
rank. Joining the group is tp/group.py; the step protocol is tp/driver.py over tp/channel.py.

Two ways to start N ranks:
- `mlx.launch --hostfile hosts.json --backend ring -- pagedmlx serve ...` (or any launcher that
  sets MLX's environment): every process joins the group the environment describes;
- `pagedmlx serve --tp N` with no launcher: this process becomes rank 0 and starts ranks 1..N-1
  as copies of its own command line, on this machine, joined by the ring backend on loopback.

Rank 0 owns the HTTP server, the scheduler and the block accounting; the other ranks only run
forward passes on their shard (`model.shard(group)`, as mlx-lm's model classes define it: attention
heads and MLP columns split, embeddings and LM head whole, so every rank ends with the full logits).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.config import EngineConfig
from pagedmlx.engine.core import EngineCore
from pagedmlx.platform import backend_name, hard_exit
from pagedmlx.runner.model import ModelRunner, UnsupportedModelError, model_type, weights_nbytes
from pagedmlx.tp.channel import RankLostError
from pagedmlx.tp.driver import TPDriver, serve_worker
from pagedmlx.tp.group import local_ranks
from pagedmlx.tp.launcher import launched_backend

logger = logging.getLogger("pagedmlx")

DEFAULT_TIMEOUT = 60.0  # seconds a step may wait on the other ranks


# ---- the model -----------------------------------------------------------------------------------

def shard_model(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Split the model across the group in place (mlx-lm's `model.shard`), then materialise the shard."""
    n, kind = group.size(), model_type(model)
    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(
            f"model type {kind!r} cannot be split across {n} ranks: its mlx-lm class has no shard() method")
    for i, layer in enumerate(getattr(model, "layers", None) or []):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        for attr in ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads", "num_attention_heads"):
            value = getattr(attn, attr, None)
            if isinstance(value, int) and value % n:
                raise UnsupportedModelError(
                    f"model type {kind!r} cannot be split across {n} ranks: layer {i} has {attr} = {value}, "
                    f"which {n} does not divide")
    try:
        model.shard(group)
    except (ValueError, RuntimeError) as e:
        raise UnsupportedModelError(f"model type {kind!r} cannot be split across {n} ranks: {e}") from e
    mx.eval(model.parameters())
    return model


_DEVICES = ("CPU", "Metal", "CUDA", "GPU")


def announce(runner: ModelRunner, group: mx.distributed.Group) -> list[str]:
    """Every rank: gather what each rank holds (a collective: all ranks call it in step). Returns
    one line per rank. Fails on every rank alike if the ranks' page pools differ."""
    mine = mx.array([weights_nbytes(runner.model), runner.kv_pool.nbytes, runner.num_blocks,
                     runner.layer_specs[0][0], _DEVICES.index(backend_name()), os.getpid()], mx.int64)
    table = mx.distributed.all_gather(mine[None], group=group, stream=mx.cpu).tolist()
    backend = launched_backend() or "ring"
    lines = [f"rank {r}/{group.size()} ({backend}, {_DEVICES[dev]}, pid {pid}): weights {w:,} B, KV pool {kv:,} B"
             f" = {nb} blocks x {runner.block_size} tokens, {heads} KV head{'s' * (heads != 1)} per layer"
             for r, (w, kv, nb, heads, dev, pid) in enumerate(table)]
    if len({row[2] for row in table}) != 1:
        raise RuntimeError("tensor parallel: the ranks' page pools differ in size (each sized its own from its memory: "
                           "give --kv-cache-gb or --num-blocks):\n  " + "\n  ".join(lines))
    return lines


def unsupported(config: EngineConfig) -> Optional[str]:
    """Why tensor parallelism cannot run this configuration yet (None: it can), said before any rank starts."""
    if config.enable_lora:
        return ("enable_lora: LoRA adapters are not served with tensor parallelism yet (the ranks' projections are "
                "mlx-lm's sharded layers, which its adapters do not target, and adapters load on rank 0 only); "
                "serve them on one rank")
    return None


def build_runner(model: nn.Module, config: EngineConfig, verify: bool = True) -> ModelRunner:
    """The same runner on every rank (its load-time check runs the sharded model: in step)."""
    return ModelRunner(model, config, verify=verify)


# ---- rank 0 --------------------------------------------------------------------------------------

class TPEngine(EngineCore):
    """EngineCore on rank 0 of a group: its runner sends each step to the other ranks. A lost rank
    raises RankLostError from step() (the step's requests fail), and every later step too."""

    def __init__(self, model: nn.Module, tokenizer: Any, config: Optional[EngineConfig], group: mx.distributed.Group,
                 timeout: float = DEFAULT_TIMEOUT, verify_model: bool = True):
        self.group, self.timeout = group, timeout
        self.rank_lines: list[str] = []
        # Lockstep steps: the other ranks get each step's token ids from the host, so a step cannot
        # take its input tokens from the previous step's sampled array still on rank 0's device.
        config = dataclasses.replace(config or EngineConfig(), async_scheduling=False)
        super().__init__(model, tokenizer, config, verify_model=verify_model)

    def make_runner(self, verify: bool) -> TPDriver:
        runner = build_runner(self.model, self.config, verify)
        self.rank_lines = announce(runner, self.group)
        return TPDriver(runner, self.group, self.timeout,
                        peers_status=local_ranks().status if local_ranks() else None)

    def step(self):
        if self.runner.lost is not None:
            raise self.runner.lost
        outputs = super().step()
        if self.runner.lost is not None:  # the step's own requests were failed above
            raise self.runner.lost
        return outputs

    def shutdown(self) -> None:
        """Let the other ranks exit; idempotent."""
        self.runner.close()
        if local_ranks() is not None:
            local_ranks().stop()


def build_engine(model: nn.Module, tokenizer: Any, config: EngineConfig, group: mx.distributed.Group,
                 timeout: float = DEFAULT_TIMEOUT) -> TPEngine:
    """Rank 0: shard the model and build the engine (the other ranks call run_worker)."""
    why = unsupported(config)
    if why:
        raise UnsupportedModelError(why)
    shard_model(model, group)
    engine = TPEngine(model, tokenizer, config, group, timeout)
    if local_ranks() is not None:
        local_ranks().starting = False  # the driver's watchdog takes over
    atexit.register(_at_exit, engine)
    return engine


def _at_exit(engine: TPEngine) -> None:
    """Stop the other ranks; after a lost rank, end the process before MLX's teardown, which
    aborts on the device thread still stuck in a collective."""
    if engine.runner.lost is not None:
        hard_exit(1)
    engine.shutdown()


def run_worker(model: nn.Module, config: EngineConfig, group: mx.distributed.Group,
               timeout: float = DEFAULT_TIMEOUT) -> int:
    """Ranks 1..N-1: shard the model, build the same runner, then run rank 0's steps until it
    stops (exit code 0) or goes away (1, with the reason on stderr)."""
    rank = group.rank()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's: it drains, then stops the ranks
    try:
        why = unsupported(config)
        if why:
            raise UnsupportedModelError(why)
        shard_model(model, group)
        runner = build_runner(model, config)
        announce(runner, group)
        serve_worker(runner, group, timeout)
    except (RankLostError, UnsupportedModelError, RuntimeError) as exc:
        print(f"pagedmlx rank {rank}: {exc}; exiting", file=sys.stderr, flush=True)
        return 1
    return 0
