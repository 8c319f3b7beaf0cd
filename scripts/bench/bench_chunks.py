"""What one streamed chunk costs to build: the pydantic model and its model_dump_json (the server's
path before issue 25) against the per-stream template (server/sse.py), for a chat and a completion
chunk, median of several rounds; the same bytes either way (tests/test_sse.py).

    python scripts/bench/bench_chunks.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.server.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice,  # noqa: E402
                                      CompletionResponse, DeltaMessage)
from pagedmlx.server.sse import ChunkTemplate, event  # noqa: E402

N, ROUNDS = 20000, 7
TEXTS = [" the", " quick", " brown", " fox", "\n", " \"quoted\"", " café", " 東京"]


def per_chunk_us(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for i in range(N):
            fn(i, TEXTS[i % len(TEXTS)])
        times.append((time.perf_counter() - t) / N * 1e6)
    return statistics.median(times)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    rid, model, created = "chatcmpl-0123456789abcdef", "mlx-community/Qwen3-8B-4bit", 1700000000
    chat = ChunkTemplate(ChatCompletionChunk(id=rid, model=model, created=created,
                                             choices=[ChatChunkChoice(index=0, delta=DeltaMessage())]))
    completion = ChunkTemplate(CompletionResponse(id=rid, model=model, created=created,
                                                  choices=[CompletionChoice(index=0, text="")]))
    rows = [
        ("chat", lambda i, t: event(ChatCompletionChunk(id=rid, model=model, created=created, choices=[
            ChatChunkChoice(index=0, delta=DeltaMessage(content=t))]).model_dump_json()),
         lambda i, t: chat.render(0, t, None, None)),
        ("completion", lambda i, t: event(CompletionResponse(id=rid, model=model, created=created, choices=[
            CompletionChoice(index=0, text=t)]).model_dump_json()),
         lambda i, t: completion.render(0, t, None, None)),
    ]
    table = Table(title=f"one streamed chunk, median of {ROUNDS} rounds of {N}")
    for col in ("chunk", "pydantic model us", "template us", "ratio"):
        table.add_column(col, justify="right")
    for name, model_fn, template_fn in rows:
        a, b = per_chunk_us(model_fn), per_chunk_us(template_fn)
        table.add_row(name, f"{a:.2f}", f"{b:.2f}", f"{a / b:.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
