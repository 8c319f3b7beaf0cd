"""Test-only entry point for tensor-parallel runs: every rank runs this script (the first one starts
the others through `--tp`, as `pagedmlx serve --tp N` does), with random-weight models from conftest.

    python tests/tp_rank.py offline OUT.json          two archs, 32 staggered requests each
    python tests/tp_rank.py serve ARGS...             `pagedmlx serve --tp 2 ARGS` on a random llama
Environment: TP_HANG_AT_STEP=k makes rank 1 stop answering at its k-th step (a hung rank);
TP_TIMEOUT: seconds a step may wait on the other ranks (offline).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # conftest, and pagedmlx from this checkout

from utils import ARCHS, make_model, make_tokenizer  # noqa: E402

TP = 2
ENGINE = dict(block_size=4, num_blocks=120, max_num_batched_tokens=96, long_prefill_token_threshold=48,
              max_num_seqs=32)
NUM_REQUESTS = 32
MAX_TOKENS = 8


def hang_rank_1_at(step: int) -> None:
    from pagedmlx.tp import driver

    real = driver.serve_worker

    def forward_then_hang(runner, group, *args):
        if group.rank() == 1:
            calls = [0]
            inner = runner.forward

            def forward(so):
                calls[0] += 1
                if calls[0] >= step:
                    time.sleep(3600)
                return inner(so)

            runner.forward = forward
        return real(runner, group, *args)

    driver.serve_worker = forward_then_hang
    import pagedmlx.tp.engine

    pagedmlx.tp.engine.serve_worker = forward_then_hang


def offline(out_path: str) -> None:
    from utils import make_prompts, run_staggered

    from pagedmlx.config import EngineConfig
    from pagedmlx.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    from pagedmlx.llm import LLM
    from pagedmlx.tp.engine import build_engine, run_worker
    from pagedmlx.tp.group import join_group

    group = join_group(TP)
    result = {}
    # qwen3 through the engine API, requests arriving a few at a time between steps.
    model = make_model("qwen3")
    timeout = float(os.environ.get("TP_TIMEOUT", 30))
    if group.rank() > 0:
        if run_worker(model, EngineConfig(**ENGINE), group, timeout):
            sys.exit(1)
    else:
        from pagedmlx.engine.llm_engine import LLMEngine

        engine = LLMEngine(core=build_engine(model, None, EngineConfig(**ENGINE), group, timeout))
        prompts = make_prompts(NUM_REQUESTS, ARCHS["qwen3"]["vocab_size"], seed=7)
        t0 = time.perf_counter()
        done = run_staggered(engine, prompts, params, seed=3)
        result["qwen3"] = dict(tokens=[done[str(i)] for i in range(len(prompts))], seconds=time.perf_counter() - t0,
                               preemptions=engine.scheduler.num_preemptions,
                               hits=engine.kv_cache_manager.stats.hits, rank_lines=engine.rank_lines,
                               free=engine.kv_cache_manager.block_pool.get_num_free_blocks())
        engine.runner.close()  # the other ranks return from run_worker; the group stays up
    # llama through the offline LLM API (the other ranks end inside the constructor).
    llm = LLM(make_model("llama"), None, tensor_parallel_size=TP, tp_timeout=timeout, **ENGINE)
    prompts = make_prompts(NUM_REQUESTS, ARCHS["llama"]["vocab_size"], seed=8)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    result["llama"] = dict(tokens=[o.outputs[0].token_ids for o in outs], seconds=time.perf_counter() - t0,
                           preemptions=engine.scheduler.num_preemptions, hits=engine.kv_cache_manager.stats.hits,
                           rank_lines=engine.rank_lines, free=engine.kv_cache_manager.block_pool.get_num_free_blocks())
    llm.close()
    with open(out_path, "w") as f:
        json.dump(result, f)


def fake_loader() -> None:
    loader = types.ModuleType("pagedmlx.loaders.loader")
    loader.load_model = lambda name, lazy=False, dtype=None: (make_model("llama"),
                                                              make_tokenizer(ARCHS["llama"]["vocab_size"]))
    loader.generation_defaults = lambda name: {}
    sys.modules["pagedmlx.loaders.loader"] = loader  # no real model: the CLI loads through this


def core_with_fake_loader(args) -> None:
    """The engine-core process (spawned: a fresh interpreter, where run_engine_core is still the real
    one) loads through the fake loader too."""
    fake_loader()
    from pagedmlx.engine import core_proc as proc

    proc.run_engine_core(args)


def serve(argv: list[str]) -> int:
    fake_loader()
    from pagedmlx.cli import main
    from pagedmlx.engine import core_proc as proc

    proc.run_engine_core = core_with_fake_loader  # what CoreProcess spawns
    return main(["serve", "--tp", str(TP), *argv])


if __name__ == "__main__":
    if os.environ.get("TP_HANG_AT_STEP"):
        hang_rank_1_at(int(os.environ["TP_HANG_AT_STEP"]))
    if sys.argv[1] == "offline":
        offline(sys.argv[2])
    else:
        sys.exit(serve(sys.argv[2:]))
