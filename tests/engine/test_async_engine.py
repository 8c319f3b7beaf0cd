"""AsyncEngine: the engine thread, per-request streams, aborts, fan-out, errors and shutdown."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from utils import assert_no_leaks, assert_solo_greedy, make_model

from pagedmlx.engine.async_engine import AsyncEngine, EngineDeadError, EngineShutdownError, TooManyRequestsError
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.outputs import EngineOutput, RequestOutputBuilder
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def make_async(**kw) -> AsyncEngine:
    engine = LLMEngine(make_model("llama"), None, EngineConfig(block_size=8, num_blocks=128, max_model_len=256))
    return AsyncEngine(engine, **kw)


async def until_idle(ae: AsyncEngine, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not await ae.call(lambda e: not e.has_unfinished_requests()
                            and all(b.ref_cnt == 0 for p in e.kv_cache_manager.block_pools for b in p.blocks)):
        assert time.monotonic() < deadline, "pages still held"
        await asyncio.sleep(0.01)


async def collect(ae: AsyncEngine, rid: str, prompt, params) -> list:
    return [out async for out in ae.generate(prompt, params, rid)]  # vLLM's argument order


def test_concurrent_generates_equal_solo_and_errors_reach_the_caller():
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]

    async def main():
        ae = make_async()
        results = await asyncio.gather(*(collect(ae, str(i), p, GREEDY) for i, p in enumerate(prompts)))
        with pytest.raises(ValueError, match="token ids must be integers"):
            await ae.add_request("bad", [1, 2, 100_000], GREEDY)
        with pytest.raises(ValueError, match="context holds 256"):
            await ae.add_request("long", list(range(1, 300)), GREEDY)
        with pytest.raises(ValueError, match="logit_bias"):
            await ae.add_request("bias", [1, 2], SamplingParams(logit_bias={9999: 1.0}))
        assert len(await collect(ae, "after", prompts[0], GREEDY)) == 8  # still serving
        ae.shutdown()
        return results

    results = asyncio.run(main())
    for i, (p, outs) in enumerate(zip(prompts, results)):  # vLLM's RequestOutputs, cumulative
        assert outs[-1].request_id == str(i) and outs[-1].prompt_token_ids == p
        assert_solo_greedy(outs[-1].outputs[0].token_ids, make_model("llama"), p, 8, i)
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])


def test_fan_out_shares_the_prompt_pages():
    async def main():
        ae = make_async()
        prompt = list(range(1, 41))  # 5 blocks of 8
        stream = await ae.add_request("req", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=4, seed=1))
        assert stream.request_ids == ["req-0", "req-1", "req-2"]
        finals = {stream.index(o.request_id): o async for o in stream if o.finished}
        assert sorted(finals) == [0, 1, 2]
        assert [finals[i].num_cached_tokens for i in range(3)] == [0, 32, 32]
        assert len({tuple(o.token_ids) for o in finals.values()}) == 1  # greedy
        await until_idle(ae)
        ae.shutdown()

    asyncio.run(main())


def test_consumers_that_leave_abort_their_requests():
    async def main():
        ae = make_async()
        reasons = {}
        ae.add_listener(lambda out, timing, now: out.finished and reasons.setdefault(out.request_id, out.finish_reason))
        async for _ in ae.generate([1, 2, 3], LONG, "brk"):
            break  # the generator is closed: the request is aborted
        await until_idle(ae)

        async def consume():
            async for _ in ae.generate([4, 5, 6], LONG, "cancelled"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until_idle(ae)

        stream = await ae.add_request("dropped", [7, 8, 9], LONG)
        del stream  # never closed: garbage collection aborts it
        gc.collect()
        await until_idle(ae)

        stream = await ae.add_request("aborted", [7, 8, 9], LONG)
        ae.abort("aborted")
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "abort"
        assert reasons == dict.fromkeys(["brk", "cancelled", "dropped", "aborted"], "abort")
        ae.shutdown()
        assert_no_leaks(ae.engine)

    asyncio.run(main())


def test_full_waiting_queue_raises():
    async def main():
        ae = make_async(max_waiting=2, start=False)  # nothing runs: every add stays waiting
        tasks = [asyncio.create_task(ae.add_request(str(i), [1, 2], GREEDY)) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(TooManyRequestsError):
            await ae.add_request("x", [1, 2], GREEDY)
        ae.start()
        for stream in await asyncio.gather(*tasks):
            assert [o async for o in stream][-1].finish_reason == "length"
        ae.shutdown()

    asyncio.run(main())


def test_engine_thread_death_reaches_every_consumer():
    async def main():
        ae = make_async()
        real_step = ae.engine.step
        calls = []

        def dying_step():
            calls.append(1)
            if len(calls) == 3:
                raise SystemError("the step loop itself broke")
            return real_step()

        ae.engine.step = dying_step
        results = await asyncio.gather(*(collect(ae, str(i), [1, 2, i + 3], LONG) for i in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", [1, 2], GREEDY)
        assert isinstance(ae.dead, SystemError)

    asyncio.run(main())


def test_shutdown_drains_then_aborts():
    async def main():
        ae = make_async()
        short = [asyncio.create_task(collect(ae, str(i), [1, 2, i + 3], GREEDY)) for i in range(3)]
        await asyncio.sleep(0.01)
        await ae.shutdown_async(timeout=10)  # long enough: they all finish
        assert all(t.result()[-1].outputs[0].finish_reason == "length" for t in short)
        with pytest.raises(EngineShutdownError):
            await ae.add_request("late", [1, 2], GREEDY)
        assert await ae.call(lambda e: e.get_num_unfinished_requests()) == 0  # runs inline now

        ae = make_async()
        slow = [asyncio.create_task(collect(ae, str(i), [1, 2, i + 3], LONG)) for i in range(3)]
        await asyncio.sleep(0.05)
        await ae.shutdown_async(timeout=0)
        assert all(t.result()[-1].outputs[0].finish_reason == "abort" for t in slow)
        assert_no_leaks(ae.engine)

    asyncio.run(main())


def test_idle_engine_thread_sleeps():
    ae = make_async()
    engine = ae.engine
    checks = []
    real = engine.has_unfinished_requests
    engine.has_unfinished_requests = lambda: (checks.append(1), real())[1]
    time.sleep(0.3)
    assert len(checks) <= 2, len(checks)  # woken by nothing: no polling
    ae.shutdown()
    assert not ae.client.thread.is_alive()


def test_an_output_read_late_holds_its_own_steps_tokens():
    """EngineOutput.token_ids is the request's growing list until it finishes: a consumer that lags
    behind the engine must still see each step's RequestOutput as it was (tokens and text agreeing)."""
    ids: list[int] = []
    outs = []
    for t in (5, 6, 7):  # three steps before the consumer reads any
        ids.append(t)
        outs.append(EngineOutput("r", [1], ids, "x" * len(ids), [t], "x", finished=t == 7,
                                 finish_reason="length" if t == 7 else None))
    builder = RequestOutputBuilder("r", None, 1)
    got = [builder.add(0, out).outputs[0] for out in outs]
    assert [o.token_ids for o in got] == [[5], [5, 6], [5, 6, 7]]
    assert [len(o.text) for o in got] == [1, 2, 3]
