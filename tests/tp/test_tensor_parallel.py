"""Tensor parallelism: two ranks on this machine (ring backend on loopback, CPU) give the
single-process engine's greedy tokens, offline and served; a killed or hung rank ends the run with
a clear error within seconds. The ranks run tests/tp_rank.py (random-weight float32 models).

Exactness: a split model sums each o_proj / down_proj over heads and columns in two halves, then
adds the halves (all_sum), so its float32 logits differ from one process's in the last bits. With
these models (weights doubled in conftest, so logits are decisive) greedy tokens still match
exactly, and the tests assert that; docs/tensor-parallel.md gives the measured logit difference.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import pytest
from utils import ARCHS, make_model, make_prompts, make_tokenizer, run_staggered, run_to_completion, wait_healthy

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.core.sched.output import SchedulerOutput, build_scheduler_output
from pagedmlx.tp import channel as tp

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
RANK_SCRIPT = os.path.join(HERE, "tp_rank.py")
sys.path.insert(0, HERE)
from tp_rank import ENGINE, MAX_TOKENS, NUM_REQUESTS  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def single_process(arch: str, prompts, staggered: bool = True) -> list[list[int]]:
    engine = LLMEngine(make_model(arch), None, EngineConfig(**ENGINE))
    if staggered:
        done = run_staggered(engine, prompts, GREEDY, seed=3)
    else:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        done = {rid: o.token_ids for rid, o in run_to_completion(engine).items()}
    return [done[str(i)] for i in range(len(prompts))]


def start_ranks(*args, env=None, **kw) -> subprocess.Popen:
    env = dict(os.environ, **(env or {}))
    return subprocess.Popen([sys.executable, RANK_SCRIPT, *args], env=env, cwd=os.path.dirname(HERE), **kw)


def test_scheduler_output_round_trips_through_the_wire_format():
    from pagedmlx.request import Request

    reqs = [Request(str(i), list(range(1, 2 + 5 * i)), SamplingParams()) for i in range(3)]
    reqs[0].num_computed_tokens = 0
    blocks = {"0": ([3], [1]), "1": ([5, 6], [2, 3]), "2": ([7, 8, 9], [0, 4, 5])}  # two KV cache groups
    so = build_scheduler_output([(reqs[0], 1), (reqs[1], 6), (reqs[2], 4)], blocks.__getitem__, 4, ["x"], {"y", "z"})
    assert so.block_table.ndim == 3 and so.slot_mapping.shape == (2, 11)
    header, payload = tp.pack(tp.STEP, 7, so)
    assert header.shape == (tp.HEADER_LEN,) and payload.dtype == np.int32
    back = tp.unpack(header, payload)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table",
                 "logits_indices"):
        np.testing.assert_array_equal(getattr(back, name), getattr(so, name), err_msg=name)
    assert back.num_decodes == so.num_decodes and back.num_scheduled_tokens == so.num_scheduled_tokens
    assert len(back.req_ids) == 3 and len(back.sampled_req_ids) == len(so.sampled_req_ids)
    assert isinstance(back, SchedulerOutput)


def test_two_ranks_offline_equal_single_process():
    """qwen3 through the engine (staggered arrivals) and llama through the offline LLM API, each
    with 32 requests, shared prefixes, chunked prefill and preemption, split over two ranks."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        proc = start_ranks("offline", out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        with open(out) as f:
            result = json.load(f)
    for arch, seed, staggered in (("qwen3", 7, True), ("llama", 8, False)):
        got = result[arch]
        assert got["preemptions"] > 0 and got["hits"] > 0, got  # the run exercised what it claims
        assert got["free"] == ENGINE["num_blocks"]  # every page back
        prompts = make_prompts(NUM_REQUESTS, ARCHS[arch]["vocab_size"], seed=seed)
        want = single_process(arch, prompts, staggered)
        for i in range(NUM_REQUESTS):
            assert got["tokens"][i] == want[i], f"{arch} request {i}"
        # Each rank holds half the KV heads, and less than the whole model's weights.
        lines = got["rank_lines"]
        assert len(lines) == 2 and all(f"{ENGINE['num_blocks']} blocks" in line for line in lines)
        assert all("1 KV head per layer" in line for line in lines)  # 2 KV heads, split in two


@pytest.mark.slow  # waits out a timeout
def test_hung_rank_fails_the_run_within_the_timeout():
    t0 = time.monotonic()
    proc = start_ranks("offline", os.devnull, env={"TP_HANG_AT_STEP": "3", "TP_TIMEOUT": "2"},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "RankLostError: tensor parallel: no answer from the other ranks within 2 s" in err
    assert time.monotonic() - t0 < 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_server_equal_single_process_then_a_killed_rank_stops_it():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--port", str(port), "--served-model-name", "tiny", "--log-level", "warning", "--tp-timeout", "10",
            "--block-size", str(ENGINE["block_size"]), "--num-blocks", str(ENGINE["num_blocks"]),
            "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"])]
    with tempfile.TemporaryFile("w+") as err:
        proc = start_ranks("serve", *args, stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            wait_healthy(url, lambda: proc.poll() is None, 60, lambda: _read(err))
            prompts = make_prompts(NUM_REQUESTS, ARCHS["llama"]["vocab_size"], seed=9)

            async def all_at_once():
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    rs = await asyncio.gather(*[client.post("/v1/completions", json={
                        "model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}) for p in prompts])
                return [r.json() for r in rs]

            bodies = asyncio.run(all_at_once())
            want = single_process("llama", prompts, staggered=False)
            for i, body in enumerate(bodies):
                assert body["choices"][0]["token_ids"] == want[i], f"request {i}: {body}"
            assert re.search(r'vllm:num_preemptions_total\{[^}]*\} [1-9]', httpx.get(url + "/metrics").text)
            assert sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies) > 0

            # Now kill rank 1 in the middle of a streamed request.
            rank1 = int(re.search(r"rank 1/2 \(ring, CPU, pid (\d+)\)", _read(err)).group(1))
            payloads: list[str] = []
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                    "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payloads.append(line[6:])
                        if len(payloads) == 3:
                            os.kill(rank1, signal.SIGKILL)
                            t_kill = time.monotonic()
            assert len(payloads) < 100 and "the engine died" in "".join(payloads), payloads[-3:]
            assert time.monotonic() - t_kill < 5  # the client heard of it at once
            assert proc.wait(timeout=10) == 1
            assert time.monotonic() - t_kill < 10
            text = _read(err)
            assert "lost a rank" in text and f"rank 1 (pid {rank1}) exited with signal SIGKILL" in text, text[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def test_models_that_cannot_be_split_are_refused_by_name():
    import types

    import mlx.nn as nn

    from pagedmlx.runner.model import UnsupportedModelError
    from pagedmlx.tp.engine import shard_model

    three = types.SimpleNamespace(size=lambda: 3, rank=lambda: 0)
    with pytest.raises(UnsupportedModelError, match=r"'llama' cannot be split across 3 ranks: layer 0 has n_heads = 8"):
        shard_model(make_model("llama_tied", seed=1), three)

    class NoShard(nn.Module):
        args = types.SimpleNamespace(model_type="mamba")

    with pytest.raises(UnsupportedModelError, match=r"'mamba' cannot be split across 3 ranks: .* no shard\(\) method"):
        shard_model(NoShard(), three)


def test_lora_adapters_with_tensor_parallelism_are_refused_before_any_rank_starts():
    from pagedmlx.llm import LLM

    with pytest.raises(ValueError, match="enable_lora: LoRA adapters are not served with tensor parallelism"):
        LLM(make_model("llama"), make_tokenizer(), tp=2, enable_lora=True)
    proc = subprocess.run([sys.executable, "-m", "pagedmlx.cli", "serve", "random:llama", "--tp", "2", "--enable-lora"],
                          capture_output=True, text=True, timeout=120, cwd=os.path.dirname(HERE))
    said = " ".join(proc.stderr.split())  # rich wraps long lines
    assert proc.returncode == 2 and "LoRA adapters are not served with tensor parallelism" in said, proc.stderr
