"""Plot decode throughput against batch size from bench_offline.py's --json output.

Both engines' aggregate decode tok/s, and (when the run measured the machine with --roofline) the
roofline: the tok/s a step would reach at the measured bandwidth and matmul rate.

  python scripts/bench/plot_benchmarks.py RUN/offline.json OUT.png ["machine, date"]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = json.load(open(sys.argv[1]))
    rows = run["rows"]
    batch = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(batch, [r["ours_decode"] for r in rows], "o-", label="pagedmlx (paged, fused decode)")
    if "lockstep_decode" in rows[0]:
        ax.plot(batch, [r["lockstep_decode"] for r in rows], "o:", color="C0", alpha=0.6,
                label="pagedmlx, lockstep steps (no host/device overlap)")
    ax.plot(batch, [r["mlx_decode"] for r in rows], "s-", label="mlx-lm BatchGenerator")
    if "ideal_ms" in rows[0]:
        ax.plot(batch, [1e3 * r["batch"] / r["ideal_ms"] for r in rows], "k--", label="roofline (measured BW, FLOP/s)")
    if run.get("single_stream"):
        ax.axhline(run["single_stream"], color="gray", lw=0.8, ls=":", label="mlx-lm generate_step, 1 stream")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batch, [str(b) for b in batch])
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("aggregate decode tokens/s")
    where = sys.argv[3] if len(sys.argv) == 4 else run["device"]
    ax.set_title(f"{run['model']}\n{where}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2])
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
