"""Shared server test helpers: an app from build_app served by a real uvicorn (make_server) on a
free loopback port in a thread, or `pagedmlx serve` as a subprocess; random-weight tiny model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx
import openai
from utils import ARCHS, make_model, make_tokenizer

from pagedmlx.engine.async_engine import AsyncEngine
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.server.api import build_app
from pagedmlx.server.http_server import make_server
from pagedmlx.server.serving import ServerLimits

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256


def engine_config(**kw) -> EngineConfig:
    cfg = dict(block_size=8, num_blocks=256, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
               max_num_batched_tokens=512)
    cfg.update(kw)
    return EngineConfig(**cfg)


def make_engine(**kw) -> LLMEngine:
    return LLMEngine(make_model("llama"), make_tokenizer(ARCHS["llama"]["vocab_size"]), engine_config(**kw))


class ServerThread:
    """make_server(app) on a free loopback port, run from a background thread."""

    def __init__(self, app):
        self.server = make_server(app, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class Served:
    def __init__(self, engine: LLMEngine, async_engine: Optional[AsyncEngine] = None, **app_kw):
        self.engine = engine
        self.async_engine = async_engine or AsyncEngine(engine)
        app_kw.setdefault("drain_timeout", 2.0)
        app_kw.setdefault("limits", ServerLimits(max_body_bytes=64 * 1024, max_n=4))
        self.app = build_app(self.async_engine, MODEL, **app_kw)
        self.thread = ServerThread(self.app)
        self.url = self.thread.url
        self.port = self.thread.port

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self) -> None:
        self.thread.stop()


def wait_idle(engine: LLMEngine, timeout: float = 2.0) -> None:
    """Every page back (ref_cnt 0) and no request left, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        blocks = engine.kv_cache_manager.block_pool.blocks
        if all(b.ref_cnt == 0 for b in blocks) and not engine.has_unfinished_requests():
            return
        assert time.monotonic() < deadline, [b for b in blocks if b.ref_cnt][:5]
        time.sleep(0.02)


def sse_payloads(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


# `pagedmlx serve` in a subprocess, with the tiny random model. The model (and mlx-lm with it) is
# loaded only when the CLI asks for it, as with a real model: the CLI's own start-up runs first.
SERVE = """
import sys
sys.path.insert(0, {tests!r})
import serve_hooks
serve_hooks.install({step_sleep})
from pagedmlx.cli import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`pagedmlx serve ARGS` on a free port; ready once /health answers 200."""

    def __init__(self, *args: str, step_sleep: float = 0.005, preexec_fn=None, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        script = SERVE.format(tests=os.path.dirname(__file__), step_sleep=step_sleep)
        argv = ["serve", "--port", str(self.port), "--block-size", "8", "--num-blocks", "256", "--max-model-len",
                "256", "--served-model-name", MODEL, "--log-level", "warning", *args]
        self.proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.communicate()
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        """Wait for the process to end: (exit status, stderr)."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def running(self, n: int) -> bool:
        text = httpx.get(self.url + "/metrics").text
        return f'vllm:num_requests_running{{model_name="{MODEL}"}} {float(n)}' in text


def raise_own_file_limit(at_least: int) -> Optional[str]:
    """Raise this process's soft open-file limit; the reason it cannot reach `at_least`, if so."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < at_least <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    elif soft < at_least:
        return f"open-file hard limit {hard} < {at_least}"
    return None
