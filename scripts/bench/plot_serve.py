"""Plot served against offline output tok/s from a serve_bench.sh run directory (scripts/gpu/).

  python scripts/bench/plot_serve.py docs/runs/2026-12-03-run37/pool-24gb OUT.png "H200, 2026-12-03"

Bars per client count: `pagedmlx bench throughput` (LLM.generate at that batch), `pagedmlx serve`
with its engine core in a process of its own and in a thread, and mlx_lm.server where it ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def tok_s(path: Path, key: str) -> float:
    return json.loads(path.read_text())[key] if path.exists() else 0.0


def main() -> None:
    if len(sys.argv) not in (3, 4, 5):
        sys.exit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, extra = Path(sys.argv[1]), [Path(p) for p in sys.argv[4:5]]
    clients = [64, 256]
    series = [("LLM.generate (offline)", lambda b: tok_s(run / f"offline{b}.json", "output_tokens_per_second")),
              ("serve: engine core process", lambda b: tok_s(run / f"serve-process-{b}.json", "output_throughput")),
              ("serve: engine core thread", lambda b: tok_s(run / f"serve-thread-{b}.json", "output_throughput")),
              ("mlx_lm.server", lambda b: max([tok_s(d / f"mlx_lm_server-{b}.json", "output_throughput")
                                               for d in [run, *extra]]))]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    width = 0.2
    for k, (label, value) in enumerate(series):
        xs = [i + (k - 1.5) * width for i in range(len(clients))]
        ys = [value(b) for b in clients]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, labels=[f"{y:,.0f}" if y else "" for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(clients)), [f"{b} clients / batch {b}" for b in clients])
    ax.set_ylabel("output tokens / s")
    title = "Llama-8B shape, bf16, 128-token prompts, 256 new"
    ax.set_title(title + (f" ({sys.argv[3]})" if len(sys.argv) > 3 else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2])
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
