"""A snapshot of the page pool and who holds what: plain, JSON-serialisable data for
`pagedmlx blocks`, GET /v1/engine/kv and tests.

Build it between steps (in the engine thread: AsyncEngine.call(kv_snapshot)); it reads the block
pool, the KV manager and the scheduler once and copies what it needs, so it can be shipped and
rendered anywhere while the engine steps on.

A model with several KV cache groups (sliding-window layers beside full-attention ones) has one
pool per group: `groups` describes each; `pool`, `block_states` and the requests' block tables are
the first group's (full attention where there is one). A recurrent-state group's blocks are state
slots: one per running request ("u"), checkpoints ("c" cached; "s"/"u" while a step reads or saves
one); its entry adds a `state` summary.

Block states, one character per block in `block_states`:
  "." free    no request holds it and it holds no reusable prefix
  "c" cached  no request holds it, but it keeps a prefix that a later request can reuse
              (until the pool hands its page out again: lazy eviction)
  "u" in use  held by one request
  "s" shared  held by more than one request (a prefix-cache hit)

`image_blocks` (and each request's): the first group's blocks that hold image placeholder tokens (pagedmlx/
multimodal/), held by a request or cached under a key that names an image.
"""

from __future__ import annotations

import re
import time
from typing import Any, Iterable

FREE, CACHED, IN_USE, SHARED = ".", "c", "u", "s"
STATE_NAMES = {FREE: "free", CACHED: "cached", IN_USE: "in use", SHARED: "shared"}
SNAPSHOT_VERSION = 2


def compress_ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 3, 40, 42, 43, 44] -> "0-3,40,42-44". Runs follow the order given (a block table's
    order): only ascending neighbours (+1) join a run, so expand_ranges gives the list back."""
    parts: list[str] = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def expand_ranges(text: str) -> list[int]:
    """The inverse of compress_ranges."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _gb(num_blocks: int, bytes_per_block: int) -> float:
    return num_blocks * bytes_per_block / 1e9


def _block_text(engine: Any, token_ids: tuple[int, ...], limit: int = 48) -> str:
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not token_ids:
        return ""
    try:
        text = tokenizer.decode(list(token_ids))
    except Exception:  # noqa: BLE001 - a preview only
        return ""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _natural(text: str) -> tuple:
    """Sort key: "r2" before "r10"."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text))


def image_block_ids(req: Any, block_ids: list[int], block_size: int) -> list[int]:
    """The blocks of a request's block table that hold placeholder tokens of its images."""
    spans = [(f.mm_position.offset, f.mm_position.end) for f in getattr(req, "mm_features", ())]
    return [b for j, b in enumerate(block_ids)
            if any(a < (j + 1) * block_size and e > j * block_size for a, e in spans)]


def _cached_image_blocks(pool: Any) -> list[int]:
    return [b.block_id for h, b in pool.cached_block_hash_to_block.items()
            if h.extra_keys and any(isinstance(k, tuple) and k[:1] == ("mm",) for k in h.extra_keys)]


def _request_row(req: Any, block_ids: list[int], held: dict, block_size: int) -> dict:
    return {
        "id": req.request_id,
        "state": req.status.name.lower(),
        "priority": req.priority,
        "prompt_tokens": req.num_prompt_tokens,
        "computed_tokens": req.num_computed_tokens,
        "output_tokens": req.num_output_tokens,
        "cached_tokens": max(req.num_cached_tokens, 0),
        "preemptions": req.num_preemptions,
        "guided": getattr(req, "structured_output_request", None) is not None,
        "blocks": len(block_ids),
        "shared_blocks": sum(1 for b in block_ids if held[b].ref_cnt > 1),
        "block_table": compress_ranges(block_ids),
        "images": len(getattr(req, "mm_features", ())),
        "image_blocks": compress_ranges(image_block_ids(req, block_ids, block_size)),
    }


def block_states(pool: Any, held_blocks: list) -> tuple[str, dict]:
    """One state character per block, and the blocks in use by id. Costs in proportion to the
    blocks in use or cached, not to the pool: a large, mostly empty pool is cheap to look at."""
    states = bytearray(FREE.encode() * len(pool.blocks))
    for block in pool.cached_block_hash_to_block.values():
        states[block.block_id] = ord(CACHED)
    held = {b.block_id: b for blocks in held_blocks for b in blocks if b is not pool.null_block}
    if len(held) != pool.num_blocks - pool.get_num_free_blocks():  # a block no request holds: a leak; show it
        held.update((b.block_id, b) for b in pool.blocks if b.ref_cnt)
    for block_id, block in held.items():
        states[block_id] = ord(SHARED if block.ref_cnt > 1 else IN_USE)
    if pool.null_block is not None:  # a sliding-window group's stand-in for pages behind the window
        del states[pool.null_block.block_id]
    return states.decode("ascii"), held


def _pool_summary(pool: Any, states: str, bpb: int) -> dict:
    counts = {state: states.count(state) for state in STATE_NAMES}
    used = counts[IN_USE] + counts[SHARED]
    return {
        "num_blocks": pool.num_blocks,
        "bytes_per_block": bpb,
        "used": used,
        "shared": counts[SHARED],
        "cached_free": counts[CACHED],
        "free": counts[FREE],
        "usage": used / pool.num_blocks if pool.num_blocks else 0.0,
        "total_gb": _gb(pool.num_blocks, bpb),
        "used_gb": _gb(used, bpb),
        "cached_free_gb": _gb(counts[CACHED], bpb),
        "free_gb": _gb(counts[FREE], bpb),
    }


def _state_summary(manager: Any) -> dict:
    return {
        "running_slots": len(manager.req_to_blocks),
        "checkpoints": len(manager.block_pool.cached_block_hash_to_block),
        "checkpoint_interval": manager.checkpoint_interval,
        "checkpoints_saved": manager.num_checkpoints_saved,
        "checkpoint_hits": manager.num_checkpoint_hits,
    }


def kv_snapshot(engine: Any, top_shared: int = 10, block_text: bool = True) -> dict:
    """The pools, the prefix cache and every unfinished request's pages, as plain data.
    Call it where nothing steps the engine meanwhile (between steps). `block_text=False` leaves out
    the decoded text of the most shared blocks (`text` is None): it is other users' prompts, which
    the server shows only to its admin key."""
    kv = engine.kv_cache_manager
    sched = engine.scheduler
    groups, group_held = [], []
    for spec, manager in zip(kv.kv_cache_config.kv_cache_groups, kv.managers):
        pool = manager.block_pool
        states, held = block_states(pool, manager.held_blocks())
        group_held.append(held)
        groups.append(dict(_pool_summary(pool, states, spec.page_size_bytes), name=spec.name,
                           window=spec.sliding_window, layers=len(spec.layer_ids), block_states=states,
                           kv_cache_dtype=spec.kv_cache_dtype,
                           bytes_per_token=0 if spec.is_state else spec.page_size_bytes // kv.block_size))
        if spec.is_state:
            groups[-1]["state"] = _state_summary(manager)
    pool, manager, held, states = kv.block_pool, kv.managers[0], group_held[0], groups[0]["block_states"]

    requests = [_request_row(r, kv.get_block_ids(r.request_id)[0], held, kv.block_size)
                for r in (*sched.running, *sched.waiting)]
    image_blocks = {b for r in requests for b in expand_ranges(r["image_blocks"])}
    image_blocks.update(_cached_image_blocks(pool))

    most_shared = sorted((b for b in held.values() if b.ref_cnt > 1), key=lambda b: (-b.ref_cnt, b.block_id))
    most_shared = most_shared[:top_shared]
    holders: dict[int, list[str]] = {b.block_id: [] for b in most_shared}
    if holders:
        for rid, ids in manager.req_to_block_ids.items():
            for b in set(ids) & holders.keys():
                holders[b].append(rid)
    shared_rows = [{
        "block_id": b.block_id,
        "ref_cnt": b.ref_cnt,
        "hash": b.block_hash.digest.hex()[:12] if b.block_hash is not None else None,
        "text": _block_text(engine, b.block_hash.token_ids if b.block_hash is not None else ()) if block_text
        else None,
        "held_by": sorted(holders[b.block_id], key=_natural),
    } for b in most_shared]

    stats = kv.stats
    return {
        "version": SNAPSHOT_VERSION,
        "time": time.time(),
        "pool": dict(_pool_summary(pool, states, groups[0]["bytes_per_block"]), block_size=kv.block_size),
        "groups": groups,
        "prefix_cache": {
            "enabled": kv.enable_caching,
            "queries": stats.queries,
            "hits": stats.hits,
            "hit_rate": stats.hit_rate,
            "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits,
            "cached_blocks": len(pool.cached_block_hash_to_block),
        },
        "scheduler": {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "preemptions": sched.num_preemptions,
            "steps": engine.stats.num_steps,
        },
        "requests": requests,
        "most_shared": shared_rows,
        "block_states": states,
        "image_blocks": compress_ranges(sorted(image_blocks)),
        "legend": STATE_NAMES,
    }
