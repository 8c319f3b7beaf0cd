"""The engine core in a process of its own (engine/core_client.py's CoreProcess, what `pagedmlx serve` runs):
the same tokens as mlx-lm alone, errors and stop strings across the boundary, aborts that free pages,
a drain that ends the process, and each side's death reaching the other. Every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from utils import assert_solo_greedy, make_model

from pagedmlx.engine.async_engine import AsyncEngine, EngineDeadError
from pagedmlx.config import EngineConfig
from pagedmlx.engine.core_client import CoreProcess, CoreStartupError
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.server.metrics import EngineSnapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
CONFIG = dict(model="random:llama-tiny", block_size=8, num_blocks=128, max_model_len=256, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def ae():
    """One engine-core process (and its front end) for the tests that leave it running: starting
    one takes seconds. Each test runs its own event loop; the front end follows."""
    ae = AsyncEngine(CoreProcess(EngineConfig(**CONFIG)))
    yield ae
    ae.shutdown(timeout=0)


async def _collect(ae: AsyncEngine, rid: str, prompt, params) -> list:
    return [out async for out in ae.generate(prompt, params, rid)]


async def _blocks_free(ae: AsyncEngine, timeout: float = 5.0) -> EngineSnapshot:
    """Wait until the core holds no request and every page is free again."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await ae.call(EngineSnapshot.take)
        if snap.num_running == snap.num_waiting == 0 and all(free == total for _, total, free, _ in snap.groups):
            return snap
        assert time.monotonic() < deadline, snap
        await asyncio.sleep(0.02)


def test_a_core_process_gives_mlx_lms_tokens_and_its_errors(ae):
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]

    async def main():
        results = await asyncio.gather(*(_collect(ae, str(i), p, GREEDY) for i, p in enumerate(prompts)))
        with pytest.raises(ValueError, match="token ids must be integers"):
            await ae.add_request("bad", [1, 2, 100_000], GREEDY)
        with pytest.raises(ValueError, match="context holds 256"):
            await ae.add_request("long", list(range(1, 300)), GREEDY)
        # A stop string is found here, in the front end; the core is told to drop the request.
        text = results[0][-1].outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        cut = await _collect(ae, "stop", prompts[0], SamplingParams(temperature=0.0, max_tokens=8, stop=[stop]))
        assert cut[-1].outputs[0].finish_reason == "stop" and cut[-1].outputs[0].text == text[:text.index(stop)]
        await _blocks_free(ae)
        return results

    results = asyncio.run(main())
    model = make_model("llama")
    for i, (p, outs) in enumerate(zip(prompts, results)):
        assert_solo_greedy(outs[-1].outputs[0].token_ids, model, p, 8, i)
        # Each output holds its own step's tokens, however late the consumer reads it (EngineOutput's lists grow).
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(set(lengths)) and lengths[0] >= 1 and lengths[-1] == 8, lengths
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"


def test_a_consumer_that_leaves_frees_its_pages(ae):
    async def main():
        stream = await ae.add_request("leaver", list(range(1, 60)), LONG)
        async for out in stream:
            if len(out.token_ids) >= 3:
                break
        stream.close()
        t0 = time.monotonic()
        await _blocks_free(ae)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5


def test_drain_aborts_what_runs_past_the_deadline_and_the_process_exits_0():
    async def main():
        ae = AsyncEngine(CoreProcess(EngineConfig(**CONFIG)))
        assert (await _collect(ae, "short", [1, 2, 3], GREEDY))[-1].outputs[0].finish_reason == "length"
        stream = await ae.add_request("long", [4, 5, 6], LONG)
        first = await stream.__anext__()
        await ae.shutdown_async(timeout=0)
        outs = [first, *[o async for o in stream]]
        assert outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < LONG.max_tokens
        return ae

    ae = asyncio.run(main())
    assert ae.client.proc.exitcode == 0 and ae.dead is None


def test_core_death_reaches_every_consumer():
    async def main():
        ae = AsyncEngine(CoreProcess(EngineConfig(**CONFIG)))
        tasks = [asyncio.create_task(_collect(ae, str(i), [1, 2, i + 3], LONG)) for i in range(3)]
        while len(ae._streams) < 3:
            await asyncio.sleep(0.01)
        os.kill(ae.client.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "exited with code -9" in str(ae.dead)
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", [1, 2], GREEDY)
        ae.client.join(5)

    asyncio.run(main())


FRONT_END = """
import sys, time
from pagedmlx.config import EngineConfig
from pagedmlx.engine.core_client import CoreProcess
core = CoreProcess(EngineConfig(model="random:llama-tiny", num_blocks=64))
print(core.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_core_exits_when_the_front_end_dies():
    front = subprocess.Popen([sys.executable, "-c", FRONT_END], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(front.stdout.readline())
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, "the engine core outlived its front end"
            time.sleep(0.05)
    finally:
        front.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) is gone too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_a_model_that_cannot_load_fails_start_up_with_its_reason():
    with pytest.raises(CoreStartupError, match="unknown random model"):
        CoreProcess(EngineConfig(model="random:no-such-arch"))


def _core_pid(server_pid: int) -> int:
    """The engine-core child of a `pagedmlx serve` process (Linux: /proc)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == server_pid and "spawn_main" in cmdline:
                return int(entry)
    raise AssertionError("no engine-core process")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the engine core's pid in /proc")
def test_serve_answers_503_and_exits_1_when_its_engine_core_dies():
    import httpx
    from server_utils import MODEL, ServeProcess

    server = ServeProcess(step_sleep=0.01)
    try:
        core_pid = _core_pid(server.proc.pid)
        payloads = []
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
                    if len(payloads) == 3:
                        os.kill(core_pid, signal.SIGKILL)
        assert payloads[-1] == "[DONE]" and "the engine died" in payloads[-2], payloads[-3:]
        code, err = server.finish(timeout=15)
        assert code == 1 and f"the engine core process (pid {core_pid}) exited with code -9" in err, err[-2000:]
    finally:
        server.kill()


def test_guided_requests_cross_the_boundary(ae):
    """A grammar travels with its SamplingParams to the core, which compiles and applies it."""
    from pagedmlx.structured_outputs.params import StructuredOutputsParams

    choices = ["red", "green", "blue"]
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices))

    async def main():
        before = await ae.call(EngineSnapshot.take)
        results = await asyncio.gather(*(_collect(ae, f"g{i}", [i + 1, 2, 3], params) for i in range(4)))
        return results, before, await ae.call(EngineSnapshot.take)

    results, before, after = asyncio.run(main())
    for outs in results:
        assert outs[-1].outputs[0].text in choices and outs[-1].outputs[0].finish_reason == "stop"
    assert after.guided_requests - before.guided_requests == 4  # /metrics: pagedmlx:structured_output_requests
    assert after.grammar_compiles - before.grammar_compiles <= 1  # one grammar, compiled once
