"""`pagedmlx bench serve | throughput`: the arrival generator, the metrics on hand-made records, SSE
parsing and the streaming client on scripted byte streams, the datasets, and both commands end to
end (bench serve against a real in-thread server with the tiny random llama)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from server_utils import MODEL, Served, make_engine

from pagedmlx.bench.arrivals import arrival_times
from pagedmlx.bench.client import RequestRecord, send_request
from pagedmlx.bench.datasets import SAFE_TOKEN_IDS, load_tokenizer, random_requests, sharegpt_requests
from pagedmlx.bench.load import Load, LoadResult, merge_results, split_load
from pagedmlx.bench.metrics import calculate_metrics, parse_goodput, result_fields, result_lines
from pagedmlx.bench.sse import SSEParser, read_payload
from pagedmlx.cli import main

VLLM_FIELDS = {"date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
               "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
               "itls", "generated_texts", "errors"}


# ---- arrivals ----------------------------------------------------------------------------------

def intervals(times: np.ndarray) -> np.ndarray:
    return np.diff(times, prepend=0.0)


def test_poisson_arrivals_are_seeded_and_keep_the_rate():
    a, b = arrival_times(20000, 50.0, 1.0, seed=3), arrival_times(20000, 50.0, 1.0, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, arrival_times(20000, 50.0, 1.0, seed=4))
    assert np.all(np.diff(a) >= 0)
    gaps = intervals(a)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=1e-9)  # scaled so the last falls at n / rate (vLLM)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_sets_the_variance_as_vllms_gamma(burstiness):
    gaps = intervals(arrival_times(20000, 10.0, burstiness, seed=0))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)  # gamma shape b: CV 1/sqrt(b)


def test_arrivals_at_infinite_rate_or_burstiness():
    assert np.array_equal(arrival_times(5, float("inf")), np.zeros(5))
    assert np.allclose(intervals(arrival_times(5, 4.0, float("inf"))), 0.25)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(5, 4.0, 0.0)


# ---- metrics -----------------------------------------------------------------------------------

def records() -> list[RequestRecord]:
    return [RequestRecord(prompt_len=10, success=True, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, output_tokens=4),
            RequestRecord(prompt_len=20, success=True, ttft=0.3, itl=[0.1], latency=0.5, output_tokens=3),
            RequestRecord(prompt_len=5, success=True, ttft=0.05, itl=[], latency=0.05, output_tokens=1),
            RequestRecord(prompt_len=7, success=False, error="HTTP 500: boom")]


def test_metrics_on_hand_made_records():
    m = calculate_metrics(records(), duration=2.0, percentiles=[50, 90], goodput=parse_goodput(["ttft:200", "tpot:50"]))
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 8)
    assert m.output_lens == [4, 3, 1, 0]
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (1.5, 4.0, 21.5)
    ttft = m.stats["ttft"]  # 100, 300, 50 ms
    assert ttft.mean == pytest.approx(150) and ttft.median == pytest.approx(100)
    assert ttft.std == pytest.approx(np.sqrt((50**2 + 150**2 + 100**2) / 3))
    assert ttft.percentiles == [(50, pytest.approx(100)), (90, pytest.approx(260))]  # numpy's linear percentile
    tpot = m.stats["tpot"]  # (0.2 - 0.1) / 3 and (0.5 - 0.3) / 2; the one-token request has none
    assert tpot.mean == pytest.approx((100 / 3 + 100) / 2)
    itl = m.stats["itl"]  # all gaps pooled: 20, 30, 50, 100 ms
    assert (itl.mean, itl.median) == (pytest.approx(50), pytest.approx(40))
    assert m.stats["e2el"].mean == pytest.approx(250)
    # goodput: the first (TTFT 100, TPOT 33) and the one-token request (TPOT counts 0) meet both SLOs
    assert m.request_goodput == pytest.approx(1.0)
    assert calculate_metrics(records(), 2.0, [99], {"e2el": 100}).request_goodput == pytest.approx(0.5)
    assert calculate_metrics(records(), 2.0, [99]).request_goodput == 0.0


def test_result_fields_and_lines_use_vllms_names():
    m = calculate_metrics(records(), 2.0, [99], {"ttft": 200})
    out = result_fields(m, records(), 2.0, ["ttft", "tpot", "itl", "e2el"], goodput=True)
    assert {"p99_ttft_ms", "mean_tpot_ms", "median_itl_ms", "std_e2el_ms"} <= set(out)
    assert out["request_goodput"] == pytest.approx(1.0) and out["errors"][3] == "HTTP 500: boom"  # TTFT 100 and 50 ms
    assert result_fields(m, records(), 2.0, ["ttft"], goodput=False)["request_goodput"] is None
    lines = result_lines(m, 2.0, ["ttft"], max_concurrency=4, request_rate=float("inf"), goodput=True)
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert (f"{'Successful requests:':<40} {3:<10}" in lines
            and f"{'Request goodput (req/s):':<40} {1.0:<10.2f}" in lines)
    assert "---------------Time to First Token----------------" in lines
    assert not any(line.startswith("Request rate configured") for line in lines)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    for bad in ["ttft", "itl:5", "ttft:x", "tpot:-1"]:
        with pytest.raises(Exception, match="goodput"):
            parse_goodput([bad])


# ---- SSE and the client --------------------------------------------------------------------------

def test_sse_parser_joins_reads_cut_anywhere():
    stream = ('data: {"choices":[{"text":"h\u00e9"}]}\r\n\r\n: ping\n\ndata: line one\r\ndata: line two\r\n\r\n'
              'event: x\ndata: [DONE]\n\n').encode()
    for cut in range(1, len(stream)):  # every split into two reads, mid-line, mid-\r\n and mid-character
        parser = SSEParser()
        got = parser.feed(stream[:cut]) + parser.feed(stream[cut:]) + parser.close()
        assert got == ['{"choices":[{"text":"h\u00e9"}]}', "line one\nline two", "[DONE]"], cut
    parser = SSEParser()
    assert parser.feed(b"data: {}\n") == [] and parser.close() == ["{}"]  # no blank line at the end


def test_read_payload():
    assert read_payload("[DONE]").done
    usage = read_payload('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}')
    assert (usage.has_choice, usage.completion_tokens, usage.prompt_tokens) == (False, 7, 3)
    assert read_payload('{"error":{"message":"boom","type":"server_error","code":500}}').error == "boom"
    assert read_payload('{"choices":[{"text":"ab"}]}').text == "ab"
    role = read_payload('{"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert role.has_choice and role.text == ""
    assert read_payload('{"choices":[{"delta":{"content":"x"}}]}').text == "x"
    assert read_payload("{not json").error.startswith("not JSON")


def scripted(reads: list, status: int = 200, pause: float = 0.0) -> httpx.AsyncClient:
    """A client whose server answers every request with these reads, `pause` seconds apart."""
    async def body():
        for chunk in reads:
            await asyncio.sleep(pause)
            yield chunk.encode() if isinstance(chunk, str) else chunk

    return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(status, content=body())))


def send(reads: list, status: int = 200, pause: float = 0.0) -> RequestRecord:
    async def go():
        async with scripted(reads, status, pause) as client:
            return await send_request(client, "http://x/v1/chat/completions", {"max_tokens": 3}, prompt_len=5)
    return asyncio.run(go())


def chat_chunk(content: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}) + "\n\n"


def test_client_times_content_chunks_and_takes_usage():
    role = 'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    usage = 'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n'
    done = "data: [DONE]\n\n"
    a, b = chat_chunk("Hel"), chat_chunk("lo!")
    rec = send([role, a[:7], a[7:] + b[:3], b[3:], chat_chunk("!"), usage + done], pause=0.03)
    assert rec.success and rec.error == "" and rec.generated_text == "Hello!!"
    assert rec.ttft >= 0.06  # the role chunk carries no text: the first token came with the second read
    assert len(rec.itl) == 2 and all(x >= 0.02 for x in rec.itl)  # "lo!" completes in the 4th read, "!" in the 5th
    assert rec.latency >= rec.ttft + sum(rec.itl) - 1e-6
    assert (rec.output_tokens, rec.prompt_len) == (4, 9)  # usage wins over the 3 chunks and the given 5
    counted = send([chat_chunk("a"), chat_chunk("b"), done])
    assert counted.success and counted.output_tokens == 2 and counted.prompt_len == 5  # no usage: chunks counted


def test_client_failures():
    err = 'data: {"error":{"message":"the engine failed","type":"server_error","code":500}}\n\n'
    rec = send([chat_chunk("a"), err, "data: [DONE]\n\n"])
    assert not rec.success and "the engine failed" in rec.error
    cut = send([chat_chunk("a")])
    assert not cut.success and "[DONE]" in cut.error
    refused = send(['{"error":{"message":"bad model"}}'], status=404)
    assert not refused.success and refused.error.startswith("HTTP 404") and "bad model" in refused.error


# ---- datasets and the split over processes -------------------------------------------------------

def test_random_dataset():
    reqs = random_requests(50, 20, 8, range_ratio=0.5, prefix_len=4, seed=1)
    lens = [r.prompt_len for r in reqs]
    assert all(len(r.prompt) == r.prompt_len for r in reqs) and 4 + 10 <= min(lens) and max(lens) <= 4 + 30
    assert len(set(lens)) > 5 and all(4 <= r.expected_output_len <= 12 for r in reqs)
    ids = np.concatenate([r.prompt for r in reqs])
    assert SAFE_TOKEN_IDS[0] <= ids.min() and ids.max() < SAFE_TOKEN_IDS[1]
    assert len({tuple(r.prompt[:4]) for r in reqs}) == 1 and len({tuple(r.prompt[4:8]) for r in reqs}) == 50
    assert [r.prompt for r in random_requests(50, 20, 8, 0.5, 4, seed=1)] == [r.prompt for r in reqs]
    tok = load_tokenizer("random:llama-tiny")
    texts = random_requests(8, 24, 4, seed=2, tokenizer=tok, as_text=True)
    assert all(isinstance(r.prompt, str) and len(tok.encode(r.prompt)) == r.prompt_len == 24 for r in texts)
    words = random_requests(3, 6, 4, as_text=True)
    assert all(len(r.prompt.split()) == 6 and r.prompt_len is None for r in words)


def test_sharegpt_dataset(tmp_path):
    tok = load_tokenizer("random:llama-tiny")
    reply = "Paris is the capital of France, the quick brown fox."
    data = [{"id": "a", "conversations": [{"from": "system", "value": "Be brief."},
                                          {"from": "human", "value": "What is the capital of France? Hello!"},
                                          {"from": "gpt", "value": reply}]},
            {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": reply}]},
            {"id": "c", "conversations": [{"from": "human", "value": "only a question"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), 3, tokenizer=tok)  # "Hi" is under 4 tokens, "c" has no reply
    assert [r.prompt for r in reqs] == ["What is the capital of France? Hello!"] * 3  # drawn again to make 3
    assert (reqs[0].expected_output_len == len(tok.encode(reply))
            and reqs[0].prompt_len == len(tok.encode(reqs[0].prompt)))
    fixed = sharegpt_requests(str(path), 1, tokenizer=tok, output_len=5, as_ids=True)[0]
    assert fixed.expected_output_len == 5 and fixed.prompt == tok.encode("What is the capital of France? Hello!")


def test_split_and_merge_over_processes():
    load = Load("u", [{"i": i} for i in range(10)], list(range(10)), {}, max_concurrency=7, request_rate=6.0, seed=5)
    parts = split_load(load, 3)
    assert [len(p.bodies) for p in parts] == [4, 3, 3] and [p.max_concurrency for p in parts] == [3, 2, 2]
    assert [p.request_rate for p in parts] == [2.0] * 3 and len({p.seed for p in parts}) == 3
    results = [LoadResult([RequestRecord(prompt_len=n) for n in p.prompt_lens], 1.0 + i, 5.0 - i, 0.5)
               for i, p in enumerate(parts)]
    merged = merge_results(results)
    assert [r.prompt_len for r in merged.records] == list(range(10))
    assert (merged.start, merged.end, merged.cpu_s) == (1.0, 5.0, 1.5)
    with pytest.raises(ValueError, match="num-processes"):
        split_load(load, 8)


# ---- end to end ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    s = Served(make_engine())
    yield s
    s.stop()


def bench_serve(served, tmp_path, *extra: str) -> tuple[int, dict]:
    rc = main(["bench", "serve", "--base-url", served.url + "/v1", "--num-prompts", "12", "--random-input-len", "16",
               "--random-output-len", "8", "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir",
               str(tmp_path), "--result-filename", "out.json", *extra])
    return rc, (json.loads((tmp_path / "out.json").read_text()) if rc == 0 else {})


def test_bench_serve_end_to_end(served, tmp_path, capsys, monkeypatch):
    import pagedmlx.bench.serve as serve

    monkeypatch.setattr(serve, "CLIENT_BUSY", -1.0)  # report every client as the bottleneck: the warning shows
    rc, out = bench_serve(served, tmp_path, "--max-concurrency", "4", "--goodput", "ttft:60000", "--num-warmups", "2")
    printed = capsys.readouterr().out
    assert rc == 0 and VLLM_FIELDS <= set(out)
    assert (out["completed"], out["failed"], out["model_id"], out["backend"]) == (12, 0, MODEL, "openai")
    assert out["output_lens"] == [8] * 12 and out["input_lens"] == [16] * 12  # token-id prompts: exact lengths
    assert out["total_output_tokens"] == 96 and out["request_goodput"] == pytest.approx(out["request_throughput"])
    assert all(len(itl) <= 7 for itl in out["itls"]) and not any(out["errors"])
    assert {"p99_ttft_ms", "p50_tpot_ms", "p90_itl_ms", "mean_e2el_ms"} <= set(out)
    assert "============ Serving Benchmark Result ============" in printed
    assert "Successful requests:                     12" in printed and "--num-processes" in printed


def test_bench_serve_chat_and_two_processes(served, tmp_path):
    rc, out = bench_serve(served, tmp_path, "--backend", "openai-chat", "--request-rate", "50", "--num-processes", "2")
    assert rc == 0 and out["completed"] == 12 and out["output_lens"] == [8] * 12 and out["num_processes"] == 2
    assert out["backend"] == "openai-chat" and out["request_rate"] == 50.0
    assert all(n > 16 for n in out["input_lens"])  # the server's count: 16 words and the chat template


def test_bench_serve_text_prompts_of_the_servers_tokenizer(served, tmp_path):
    rc, out = bench_serve(served, tmp_path, "--text-prompts", "--tokenizer", "random:llama-tiny")  # the served one's
    assert rc == 0 and out["completed"] == 12 and out["input_lens"] == [16] * 12 and out["output_lens"] == [8] * 12


def test_bench_serve_stops_when_the_test_request_fails(served, tmp_path, capsys):
    rc, _ = bench_serve(served, tmp_path, "--model", "no-such-model")
    assert rc == 1 and "initial test run failed" in capsys.readouterr().err


def test_bench_throughput_end_to_end(tmp_path, capsys):
    path = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "random:llama-tiny", "--num-blocks", "128", "--max-model-len", "128",
               "--input-len", "16", "--output-len", "8", "--num-prompts", "6", "--disable-tqdm",
               "--output-json", str(path)])
    out = json.loads(path.read_text())
    assert rc == 0 and out["num_requests"] == 6 and out["total_num_tokens"] == 6 * (16 + 8)
    assert out["total_output_tokens"] == 48 and out["requests_per_second"] == pytest.approx(6 / out["elapsed_time"])
    assert out["tokens_per_second"] == pytest.approx(144 / out["elapsed_time"])
    assert {"elapsed_time", "output_tokens_per_second"} <= set(out)
    assert capsys.readouterr().out.startswith("Throughput: ")


def test_bench_latency_end_to_end(tmp_path, capsys):
    """vLLM's `bench latency`: one batch run to the end per iteration, its JSON fields, prefix caching off."""
    from pagedmlx.cli import make_parser

    assert make_parser().parse_args(["bench", "latency"]).enable_prefix_caching is False
    path = tmp_path / "lat.json"
    rc = main(["bench", "latency", "random:llama-tiny", "--num-blocks", "64", "--max-model-len", "128",
               "--input-len", "16", "--output-len", "8", "--batch-size", "3", "--num-iters-warmup", "1",
               "--num-iters", "4", "--disable-tqdm", "--output-json", str(path)])
    out = json.loads(path.read_text())
    assert rc == 0 and len(out["latencies"]) == 4 and all(t > 0 for t in out["latencies"])
    assert out["avg_latency"] == pytest.approx(sum(out["latencies"]) / 4)
    assert list(out["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(out["latencies"]) <= out["percentiles"]["10"] <= out["percentiles"]["99"] <= max(out["latencies"])
    assert "spec_decode" not in out
    printed = capsys.readouterr().out
    assert printed.startswith("Avg latency: ") and "(24 tokens an iteration)" in printed
    assert main(["bench", "latency", "random:llama-tiny", "--num-blocks", "64", "--input-len", "8", "--output-len",
                 "4", "--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "2", "--disable-tqdm",
                 "--disable-detokenize"]) == 0


def test_bench_latency_reports_the_drafts_acceptance(tmp_path, capsys):
    path = tmp_path / "lat.json"
    spec = '{"method": "draft_model", "model": "random:llama-tiny", "num_speculative_tokens": 2}'
    rc = main(["bench", "latency", "random:llama-tiny", "--num-blocks", "64", "--max-model-len", "128",
               "--input-len", "16", "--output-len", "8", "--batch-size", "1", "--num-iters-warmup", "1",
               "--num-iters", "2", "--temperature", "0", "--speculative-config", spec, "--disable-tqdm",
               "--output-json", str(path)])
    spec_out = json.loads(path.read_text())["spec_decode"]
    assert rc == 0 and 0 < spec_out["num_drafts"] <= spec_out["num_draft_tokens"] <= 2 * spec_out["num_drafts"]
    assert spec_out["num_accepted_tokens"] <= spec_out["num_draft_tokens"]
    assert "Speculative decoding: " in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--num-iters", "0"], "--num-iters must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--num-iters-warmup", "-2"], "--num-iters-warmup must be >= 0, got -2"),
    (["--input-len", "100", "--output-len", "100"], "exceeds the model's max_model_len 128"),
])
def test_bench_latency_refuses_bad_flags_by_name(capsys, flags, message):
    rc = main(["bench", "latency", "random:llama-tiny", "--num-blocks", "64", "--max-model-len", "128",
               "--disable-tqdm", *flags])
    assert rc == 2 and message in capsys.readouterr().err
