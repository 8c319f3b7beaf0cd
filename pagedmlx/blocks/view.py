"""`pagedmlx blocks`: get a KV snapshot (from a server's GET /v1/engine/kv, or from an engine in
this process through the same kv_snapshot) and show it with rich: a summary panel, the requests
and their block tables, the most shared blocks and a picture of the pool, one cell per block."""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import time
from collections import Counter
from datetime import datetime
from typing import Any, Callable, Optional, Union

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pagedmlx.blocks.snapshot import CACHED, FREE, IN_USE, SHARED, STATE_NAMES, expand_ranges, kv_snapshot

STYLES = {FREE: "grey42", CACHED: "dodger_blue1", IN_USE: "green3", SHARED: "dark_orange"}
CELL = "■"
IMAGE_CELL = "▣"  # a block holding image placeholder tokens (in its state's colour)
PRIORITY = (SHARED, IN_USE, CACHED, FREE)  # breaks ties when one cell stands for several blocks
Source = Union[str, Any]  # a server URL, an LLMEngine or an AsyncEngine


class SnapshotError(RuntimeError):
    pass


def kv_url(url: str) -> str:
    """http://host:port, http://host:port/ or http://host:port/v1 -> http://host:port/v1/engine/kv."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return base + "/v1/engine/kv"


def get_snapshot(source: Source, api_key: Optional[str] = None, timeout: float = 10.0) -> dict:
    """A snapshot from a server URL (httpx), an AsyncEngine (built in its engine thread, between
    steps; call from outside its event loop) or an LLMEngine nobody is stepping right now."""
    if isinstance(source, str):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            r = httpx.get(kv_url(source), headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise SnapshotError(f"cannot reach {source}: {exc}") from exc
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - not our error shape
                message = r.text[:200]
            raise SnapshotError(f"{kv_url(source)} answered {r.status_code}: {message}")
        return r.json()
    if hasattr(source, "call") and hasattr(source, "engine"):
        return asyncio.run(source.call(kv_snapshot))
    return kv_snapshot(source)


# ---- pieces of the view ------------------------------------------------------------------------

def _size(num_blocks: int, bytes_per_block: int) -> str:
    n = num_blocks * bytes_per_block
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= 0.1 * scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.1f} kB"


def _per_token(g: dict) -> str:
    """", 69,632 B/token of int8 pages" (snapshots from before the field: nothing)."""
    if not g.get("bytes_per_token"):
        return ""
    return f", {g['bytes_per_token']:,} B/token" + (f" of {g['kv_cache_dtype']} pages"
                                                    if g.get("kv_cache_dtype") else "")


def summary_panel(snap: dict) -> Panel:
    p, pc, s = snap["pool"], snap["prefix_cache"], snap["scheduler"]
    n, bpb = p["num_blocks"], p["bytes_per_block"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    groups = snap.get("groups", [])
    name = f" ({groups[0]['name']}, {groups[0]['layers']} layers)" if len(groups) > 1 else ""
    if groups and "state" in groups[0]:  # no pages at all (Mamba2): the first group is the state slots'
        grid.add_row("state", state_text(groups[0]))
    else:
        grid.add_row("pool", f"{n} blocks × {p['block_size']} tokens = {_size(n, bpb)} "
                             f"({_size(1, bpb)} per block{_per_token(groups[0] if groups else {})}){name}")
        grid.add_row("in use", f"[{STYLES[IN_USE]}]{p['used']}[/] blocks ({p['usage']:.1%}, {_size(p['used'], bpb)}), "
                               f"[{STYLES[SHARED]}]{p['shared']}[/] of them shared")
        grid.add_row("cached", f"[{STYLES[CACHED]}]{p['cached_free']}[/] free blocks keep a reusable prefix "
                               f"({_size(p['cached_free'], bpb)})")
        grid.add_row("free", f"{p['free']} blocks ({_size(p['free'], bpb)})")
    for g in groups[1:]:  # the other KV cache groups (sliding-window layers, recurrent state)
        if "state" in g:
            grid.add_row("state", state_text(g))
            continue
        grid.add_row(g["name"], f"{g['layers']} layers: {g['num_blocks']} blocks = "
                                f"{_size(g['num_blocks'], g['bytes_per_block'])}{_per_token(g)}; "
                                f"[{STYLES[IN_USE]}]{g['used']}[/] in "
                                f"use ({g['usage']:.1%}), [{STYLES[CACHED]}]{g['cached_free']}[/] cached, "
                                f"{g['free']} free")
    if pc["enabled"]:
        line = f"hit rate {pc['hit_rate']:.1%} ({pc['hits']} of {pc['queries']} prompt tokens)"
        if pc["preempted_queries"]:
            line += f"; after preemption {pc['preempted_hits']} of {pc['preempted_queries']}"
        grid.add_row("prefix cache", line)
    else:
        grid.add_row("prefix cache", "off")
    grid.add_row("requests", f"{s['running']} running, {s['waiting']} waiting; "
                             f"{s['preemptions']} preemptions in {s['steps']} steps")
    when = datetime.fromtimestamp(snap["time"]).strftime("%H:%M:%S")
    model = f" {snap['model']}" if snap.get("model") else ""
    return Panel(grid, title=f"[bold]pagedmlx KV pool[/]{model}", subtitle=when, expand=False)


def state_text(g: dict) -> str:
    """A recurrent-state group: its slots, the running requests' and the checkpoints' shares of them."""
    s = g["state"]
    every = f"every {s['checkpoint_interval']} tokens and " if s["checkpoint_interval"] else ""
    saving = (f"; checkpoints {every}at each prompt's last full block: {s['checkpoints_saved']} saved, "
              f"{s['checkpoint_hits']} resumed from" if s["checkpoint_interval"]
              else "; no checkpoints (no prefix hits)")
    return (f"{g['layers']} layers: {g['num_blocks']} slots = {_size(g['num_blocks'], g['bytes_per_block'])}; "
            f"[{STYLES[IN_USE]}]{s['running_slots']}[/] running, [{STYLES[CACHED]}]{s['checkpoints']}[/] checkpoints, "
            f"{g['free']} free" + saving)


def short_id(request_id: str, width: int = 10) -> str:
    """Server ids are 32 hex digits; their first ones are enough to tell requests apart."""
    return request_id if len(request_id) <= width else request_id[:width - 1] + "…"


def _fixed(table: Table, names: tuple[str, ...], widths: dict[str, int], justify: str = "right") -> None:
    for name in names:
        table.add_column(name, justify=justify, no_wrap=True, width=widths.get(name, max(len(name), 5)))


def requests_table(snap: dict, width: int = 100, max_rows: int = 20) -> Table:
    """One row per request. Narrow terminals lose the `computed` and `cached` columns; the block
    table wraps between ranges."""
    reqs = snap["requests"]
    table = Table(title=f"requests ({len(reqs)})", title_justify="left", expand=False,
                  caption=f"… and {len(reqs) - max_rows} more" if len(reqs) > max_rows else None)
    numbers = ("prompt", "computed", "output", "cached", "blocks", "shared") if width >= 100 else \
        ("prompt", "output", "blocks", "shared")
    _fixed(table, ("id", "state"), {"id": 10, "state": 10}, justify="left")
    _fixed(table, numbers, {"computed": 8})
    table.add_column("block table", min_width=9)
    for r in reqs[:max_rows]:
        cells = {"prompt": r["prompt_tokens"], "computed": r["computed_tokens"], "output": r["output_tokens"],
                 "cached": r["cached_tokens"], "blocks": r["blocks"],
                 "shared": f"[{STYLES[SHARED]}]{r['shared_blocks']}[/]" if r["shared_blocks"] else "0"}
        state = (r["state"] + (f" ×{r['preemptions']}" if r["preemptions"] else "")
                 + (" guided" if r.get("guided") else "") + (f" {r['images']} img" if r.get("images") else ""))
        table.add_row(short_id(r["id"]), state, *(str(cells[n]) for n in numbers),
                      r["block_table"].replace(",", ", ") or "-")
    return table


def shared_table(snap: dict) -> Table:
    table = Table(title="most shared blocks", title_justify="left", expand=False)
    _fixed(table, ("block", "refs"), {"refs": 4})
    _fixed(table, ("hash",), {"hash": 12}, justify="left")
    table.add_column("tokens", ratio=3, min_width=10)
    table.add_column("held by", ratio=2, min_width=10)
    for b in snap["most_shared"]:
        held = ", ".join(short_id(h, 8) for h in b["held_by"][:3])
        held += f" +{len(b['held_by']) - 3}" if len(b["held_by"]) > 3 else ""
        table.add_row(str(b["block_id"]), str(b["ref_cnt"]), b["hash"] or "-", repr(b["text"]) if b["text"] else "",
                      held)
    return table


def cell_states(states: str, per_cell: int) -> list[str]:
    """One state per cell: a cell of several blocks shows the state most of them are in."""
    if per_cell == 1:
        return list(states)
    out = []
    for i in range(0, len(states), per_cell):
        counts = Counter(states[i:i + per_cell])
        out.append(max(PRIORITY, key=lambda s: (counts[s], -PRIORITY.index(s))))
    return out


def grid_shape(num_blocks: int, width: int, max_rows: int = 32) -> tuple[int, int]:
    """(columns, blocks per cell) for a grid that fits `width` characters and `max_rows` rows."""
    label = len(str(num_blocks)) + 1
    cols = max(8, min(64, (width - label - 4) // 8 * 8))
    per_cell = max(1, math.ceil(num_blocks / (cols * max_rows)))
    return cols, per_cell


def pool_picture(snap: dict, width: int = 100, max_rows: int = 32) -> Panel:
    states = snap["block_states"]
    cols, per_cell = grid_shape(len(states), width, max_rows)
    cells = cell_states(states, per_cell)
    images = {b // per_cell for b in expand_ranges(snap.get("image_blocks", ""))}
    label = len(str(len(states)))
    text = Text()
    for row in range(0, len(cells), cols):
        text.append(f"{row * per_cell:>{label}} ", style="grey50")
        for i, state in enumerate(cells[row:row + cols], row):
            text.append(IMAGE_CELL if i in images else CELL, style=STYLES[state])
        text.append("\n")
    counts = Counter(states)
    legend = Text()
    for state in (FREE, CACHED, IN_USE, SHARED):
        legend.append(f"{CELL} ", style=STYLES[state])
        legend.append(f"{STATE_NAMES[state]} {counts[state]}   ")
    if images:
        legend.append(f"{IMAGE_CELL} image tokens {len(expand_ranges(snap['image_blocks']))}   ")
    if per_cell > 1:
        legend.append(f"(1 cell = {per_cell} blocks: the state most of them are in)", style="italic")
    return Panel(Group(text, legend), title="pool: one cell per block" if per_cell == 1 else "pool", expand=False)


def render(snap: dict, width: int = 100, max_rows: int = 20) -> RenderableType:
    parts: list[RenderableType] = [summary_panel(snap), pool_picture(snap, width)]
    if snap["requests"]:
        parts.append(requests_table(snap, width, max_rows))
    if snap["most_shared"]:
        parts.append(shared_table(snap))
    return Group(*parts)


# ---- outputs ----------------------------------------------------------------------------------

def save_svg(snap: dict, path: str, width: int = 100, max_rows: int = 20) -> None:
    """The terminal view as an SVG (rich's export: a terminal window a browser can open)."""
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    console.print(render(snap, width, max_rows))
    console.save_svg(path, title="pagedmlx blocks")


def watch(fetch: Callable[[], dict], interval: float = 1.0, console: Optional[Console] = None,
          iterations: Optional[int] = None) -> None:
    """Refresh the view in place every `interval` seconds until Ctrl-C (or `iterations` refreshes)."""
    from rich.live import Live

    console = console or Console()

    def frame() -> RenderableType:
        try:
            return render(fetch(), console.width)
        except SnapshotError as exc:
            return Panel(str(exc), title="pagedmlx blocks", style="red")

    try:
        with Live(frame(), console=console, auto_refresh=False) as live:
            for _ in itertools.count(1) if iterations is None else range(1, iterations):
                time.sleep(interval)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:  # Ctrl-C ends the watch, whatever it was doing
        pass
