"""The CLI's output where it is read by people and by log files: --version, generate's closing stats,
serve's start-up lines unwrapped when piped and its model served under its own name, bench serve's
progress when piped."""

from __future__ import annotations

import argparse
import io
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import free_port

import pagedmlx
from pagedmlx.bench.progress import LineProgress, request_progress
from pagedmlx.cli import main
from pagedmlx.server.launch import served_model_name


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"pagedmlx {pagedmlx.__version__}\n"


def test_generate_prints_mlx_lm_stats_lines(capsys):
    assert main(["generate", "random:llama-tiny", "--prompt", "hi", "--max-tokens", "6", "--no-chat-template"]) == 0
    err = capsys.readouterr().err.splitlines()
    i = err.index("==========")
    assert err[i + 1].startswith("Prompt: 2 tokens, ") and err[i + 1].endswith(" tokens-per-sec")
    assert err[i + 2].startswith("Generation: ") and err[i + 2].endswith(" tokens-per-sec")
    assert err[i + 3].startswith("Peak memory: ") and err[i + 3].endswith(" GB")


def test_the_engines_start_up_lines_show_while_it_loads(monkeypatch, capsys):
    import importlib
    import logging

    cli_main = importlib.import_module("pagedmlx.cli.main")  # the module (pagedmlx.cli.main is also its function)

    def build_engine(config):
        logging.getLogger("pagedmlx").info("compiled 4 paged kernel variants in 1.5 s")
        return "engine"

    monkeypatch.setattr(cli_main, "build_engine", build_engine)
    assert cli_main.load_engine(argparse.Namespace(), "generate") == "engine"
    assert "compiled 4 paged kernel variants in 1.5 s" in capsys.readouterr().err
    logging.getLogger("pagedmlx").info("after the load")  # the engine's own handlers only, as before
    assert "after the load" not in capsys.readouterr().err


@pytest.mark.parametrize("model,name", [
    (None, "SmolLM2-135M-Instruct"), ("pypi:gemma-3-270m", "gemma-3-270m"), ("/models/x/Qwen3-0.6B.gguf", "Qwen3-0.6B"),
    ("mlx-community/Qwen3-0.6B-bf16", "mlx-community/Qwen3-0.6B-bf16"), ("./my-model/", "./my-model"),
])
def test_served_model_name_is_the_models_own(model, name):
    assert served_model_name(argparse.Namespace(served_model_name=None), model) == name
    assert served_model_name(argparse.Namespace(served_model_name="m"), model) == "m"


def test_serve_names_the_model_and_keeps_start_up_lines_whole_when_piped():
    """Stderr to a pipe (not a terminal): rich would wrap at 80 columns. The model is served under its
    argument, and `default` still names it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagedmlx.cli", "serve", "random:llama-tiny", "--port", str(port),
                             "--num-blocks", "64", "--max-model-len", "128", "--no-engine-process",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["random:llama-tiny"]
        assert 'vllm:num_requests_running{model_name="random:llama-tiny"}' in httpx.get(url + "/metrics").text
        for model in ("random:llama-tiny", "default"):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "random:llama-tiny"
        assert httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    lines = err.splitlines()
    assert any(line.startswith("pagedmlx serving random:llama-tiny on ") and line.endswith("engine core: a thread of "
                                                                                           "the server's process")
               for line in lines), err
    connections = [line for line in lines if line.startswith("  connections: at most ")]
    assert len(connections) == 1 and len(connections[0]) > 80 and connections[0].endswith("drain 30 s"), err


def test_serve_takes_its_port_before_the_engine_starts():
    """A port in use ends `serve` at once, before an engine-core process is started (vLLM's order)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pagedmlx.cli", "serve", "random:llama-tiny", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "engine core" not in proc.stderr and time.monotonic() - start < 30


def test_line_progress_when_piped():
    out = io.StringIO()
    progress = LineProgress(25, file=out, interval=3600)
    for _ in range(25):
        progress.advance()
    progress.close()
    shown = [line.split(" in ")[0] for line in out.getvalue().splitlines()]
    assert shown == ["requests: 2/25 (8%)", "requests: 4/25 (16%)", "requests: 6/25 (24%)", "requests: 8/25 (32%)",
                     "requests: 10/25 (40%)", "requests: 12/25 (48%)", "requests: 14/25 (56%)",
                     "requests: 16/25 (64%)", "requests: 18/25 (72%)", "requests: 20/25 (80%)",
                     "requests: 22/25 (88%)", "requests: 24/25 (96%)", "requests: 25/25 (100%)"]


def test_request_progress_is_plain_lines_on_a_pipe(capsys):
    with request_progress(3) as progress:
        progress.update(1)
        progress.update(3)
    assert [line.split(" in ")[0] for line in capsys.readouterr().err.splitlines()] == [
        "requests: 1/3 (33%)", "requests: 3/3 (100%)"]
    with request_progress(3, disable=True) as progress:
        progress.update(3)
    assert capsys.readouterr().err == ""
