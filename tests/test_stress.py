"""scripts/stress.py: its verifier catches mixed-up answers, leaked markers, 5xx and leaks; it fails
against a server that mixes up rows; a short run against `pagedmlx serve --model random:llama-tiny`
passes (the CI form of the stress test)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import mlx.core as mx
import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)

import stress  # noqa: E402
from stress_check import Reference, Result, check_answer, check_invalid, check_pool, marker, verify  # noqa: E402


def ref() -> Reference:
    return Reference([5, 6, 7], "hello [#q001] abc", "length", 12, [1, 2, 3])


def answer(**kw) -> Result:
    fields = dict(job="j001", mode="stream", status=200, token_ids=[5, 6, 7], text="hello [#q001] abc",
                  finish_reason="length", prompt_tokens=12)
    fields.update(kw)
    return Result(**fields)


def kinds(problems) -> list[str]:
    return [k for k, _ in problems]


def test_check_answer():
    assert check_answer(answer(), ref(), "[#q001]", echoed=True) == []
    assert kinds(check_answer(answer(token_ids=[5, 7, 6]), ref(), "[#q001]", True)) == ["mismatch"]
    assert kinds(check_answer(answer(text="hello [#q001] abd"), ref(), "[#q001]", True)) == ["text_mismatch"]
    assert kinds(check_answer(answer(finish_reason="stop"), ref(), "[#q001]", True)) == ["finish_mismatch"]
    assert kinds(check_answer(answer(prompt_tokens=13), ref(), "[#q001]", True)) == ["prompt_mismatch"]
    assert kinds(check_answer(answer(prompt_token_ids=[1, 2, 4]), ref(), "[#q001]", True)) == ["prompt_mismatch"]
    # Another prompt's marker that the solo answer did not write is a leak ...
    assert kinds(check_answer(answer(text="hello [#q001] abc [#q017]"), ref(), "[#q001]", True)) == \
        ["text_mismatch", "marker_leak"]
    # ... but a real model may write marker-like text itself: the same in its solo answer is no leak.
    wrote = ref()
    wrote.text = "hello [#q001] abc [#q017]"
    assert check_answer(answer(text=wrote.text), wrote, "[#q001]", True) == []
    assert kinds(check_answer(answer(), ref(), "[#q002]", True)) == ["marker_missing"]
    assert kinds(check_answer(answer(status=503), ref(), "[#q001]", True)) == ["http_5xx"]
    assert kinds(check_answer(answer(status=400), ref(), "[#q001]", True)) == ["valid_4xx"]
    assert kinds(check_answer(answer(error_kind="stream_error", error="boom"), ref(), "[#q001]", True)) == \
        ["stream_error"]


def test_check_invalid_and_pool():
    assert check_invalid(400) is None and check_invalid(404) is None and check_invalid(413) is None
    assert check_invalid(500) == "http_5xx" and check_invalid(200) == "invalid_not_4xx"
    snap = {"pool": {"used": 0, "free": 6, "cached_free": 2, "num_blocks": 8},
            "scheduler": {"running": 0, "waiting": 0}}
    assert check_pool(snap) is None
    snap["pool"].update(used=1, free=5)
    assert "1 blocks still in use" in check_pool(snap)


def test_verify_swapped_responses_fail():
    """A server that hands one request's answer to another fails the run."""
    refs = {"j001": ref(), "j002": Reference([9, 9], "bye [#q002] zz", "length", 7)}
    markers, echoed = {"j001": "[#q001]", "j002": "[#q002]"}, {"j001": True, "j002": True}
    good = [answer(), answer(job="j002", token_ids=[9, 9], text="bye [#q002] zz", prompt_tokens=7),
            Result("bad_json", "invalid", status=400), Result("j001", "disconnect", status=200, token_ids=[5])]
    assert not verify(good, refs, markers, echoed).failed
    swapped = [answer(job="j002"), answer(token_ids=[9, 9], text="bye [#q002] zz", prompt_tokens=7)]
    v = verify(swapped, refs, markers, echoed)
    assert v.failed and {"mismatch", "marker_leak", "prompt_mismatch"} <= set(v.errors)
    assert verify([Result("bad_json", "invalid", status=500)], refs, markers, echoed).failed
    assert verify([Result("bad_json", "invalid", status=200)], refs, markers, echoed).failed
    assert verify([Result("j001", "disconnect", status=500)], refs, markers, echoed).failed
    assert verify([answer(error_kind="transport", error="reset")], refs, markers, echoed).failed


def test_jobs_are_deterministic_and_marked():
    jobs = stress.make_jobs(24, seed=3, max_tokens=16)
    assert [j.body for j in jobs] == [j.body for j in stress.make_jobs(24, seed=3, max_tokens=16)]
    assert len({j.marker for j in jobs}) == 24 and jobs[5].marker == marker(5)
    for j in jobs:
        prompt = j.body.get("prompt") or j.body["messages"][-1]["content"]
        assert j.marker in prompt and 1 <= j.body["max_tokens"] <= 16
    assert {j.endpoint for j in jobs} == {"completions", "chat/completions"}
    assert any("seed" in j.body for j in jobs) and any(j.body["temperature"] == 0.0 for j in jobs)


def test_stress_fails_against_a_server_that_mixes_up_rows(capsys):
    """Rows of a batch get each other's logits (rolled by one): answers alone are right, under load wrong."""
    from test_server import Served, make_engine

    engine = make_engine()
    forward = engine.runner.forward
    engine.runner.forward = lambda so, *a: (lambda x: mx.roll(x, 1, axis=0) if x.shape[0] > 1 else x)(forward(so, *a))
    s = Served(engine)
    try:
        rc = stress.main(["--url", s.url, "--clients", "8", "--requests", "60", "--jobs", "8", "--max-tokens", "8"])
    finally:
        s.stop()
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "mismatch" in out


@pytest.mark.stress
def test_stress_short_run_passes():
    """The CI form: 24 clients for 25 s against `pagedmlx serve --model random:llama-tiny` (spawned),
    with a pool small enough to preempt."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "stress.py"), "--random-model", "llama-tiny",
                           "--clients", "24", "--duration", "25", "--num-blocks", "96"],
                          capture_output=True, text=True, timeout=170, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "0 of 96 blocks in use" in proc.stdout
    assert time.monotonic() - t0 < 120
