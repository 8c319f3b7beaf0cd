"""The KV inspector: kv_snapshot's exact counts on an in-process engine, compressed block tables,
GET /v1/engine/kv (behind the API key), `pagedmlx blocks` (--json, --svg, --png) on a real server."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from utils import make_model, make_tokenizer

from pagedmlx.blocks.snapshot import compress_ranges, expand_ranges, kv_snapshot
from pagedmlx.blocks.view import get_snapshot, render, save_svg, watch
from pagedmlx.cli import main
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.sampling_params import SamplingParams

PREFIX = list(range(10, 18))  # two full blocks of 4
A = PREFIX + [40, 41, 42]  # 11 tokens
B = PREFIX + [50, 51, 52, 53, 54]  # 13 tokens


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def subset(row: dict, **want) -> bool:
    return {k: row[k] for k in want} == want


@pytest.fixture
def engine() -> LLMEngine:
    # Lockstep steps, so that each step() leaves every request exactly one step further.
    cfg = EngineConfig(block_size=4, num_blocks=32, max_model_len=64, max_num_batched_tokens=256,
                       async_scheduling=False)
    return LLMEngine(make_model("llama"), make_tokenizer(512), cfg)


def test_compress_ranges():
    assert compress_ranges([0, 1, 2, 3, 40, 42, 43, 44]) == "0-3,40,42-44"
    assert compress_ranges([]) == "" and compress_ranges([7]) == "7"
    assert compress_ranges([5, 4, 3, 9, 10]) == "5,4,3,9-10"  # a table's order is kept
    assert expand_ranges("0-3,40,42-44") == [0, 1, 2, 3, 40, 42, 43, 44] and expand_ranges("") == []


@given(st.lists(st.integers(0, 60), max_size=40))
def test_ranges_round_trip(ids):
    assert expand_ranges(compress_ranges(ids)) == ids


def test_snapshot_counts_sharing_and_cached_free(engine):
    engine.add_request("A", A, greedy(3))
    engine.step()  # A: 11 prompt tokens in blocks 0-2; the two full ones (0, 1) are cached
    engine.add_request("B", B, greedy(2))
    engine.step()  # B finds blocks 0, 1 in the cache and takes 3, 4 for its own 5 tokens
    engine.add_request("C", [7, 8, 9], greedy(1))  # waiting: not scheduled yet

    snap = kv_snapshot(engine)
    json.dumps(snap)  # plain data
    pool = snap["pool"]
    assert (pool["num_blocks"], pool["used"], pool["shared"], pool["cached_free"], pool["free"]) == (32, 5, 2, 0, 27)
    assert pool["bytes_per_block"] == engine.runner.bytes_per_block
    assert pool["used_gb"] == pytest.approx(5 * engine.runner.bytes_per_block / 1e9)
    assert snap["block_states"] == "ss" + "uuu" + "." * 27
    rows = {r["id"]: r for r in snap["requests"]}
    assert [r["id"] for r in snap["requests"]] == ["A", "B", "C"]
    assert subset(rows["A"], state="running", prompt_tokens=11, computed_tokens=12, output_tokens=2,
                  cached_tokens=0, blocks=3, shared_blocks=2, block_table="0-2")
    assert (rows["B"]["computed_tokens"], rows["B"]["output_tokens"], rows["B"]["cached_tokens"]) == (13, 1, 8)
    assert (rows["B"]["blocks"], rows["B"]["shared_blocks"], rows["B"]["block_table"]) == (4, 2, "0-1,3-4")
    assert (rows["C"]["state"], rows["C"]["blocks"], rows["C"]["block_table"]) == ("waiting", 0, "")
    assert [(b["block_id"], b["ref_cnt"], b["held_by"]) for b in snap["most_shared"]] == [(0, 2, ["A", "B"]),
                                                                                        (1, 2, ["A", "B"])]
    assert len(snap["most_shared"][0]["hash"]) == 12
    assert snap["most_shared"][0]["text"] == make_tokenizer(512).decode(PREFIX[:4])
    assert subset(snap["prefix_cache"], queries=24, hits=8, hit_rate=8 / 24)
    assert snap["scheduler"] == {"running": 2, "waiting": 1, "preemptions": 0, "steps": 2}

    engine.abort_request(["C"])
    while engine.has_unfinished_requests():
        engine.step()
    snap = kv_snapshot(engine)
    # A's blocks 0-2 and B's block 3 are full and keep their prefixes; A's 5 and B's 4 were partial.
    assert (snap["pool"]["used"], snap["pool"]["cached_free"], snap["pool"]["free"]) == (0, 4, 28)
    assert snap["block_states"] == "cccc" + "." * 28
    assert snap["requests"] == [] and snap["most_shared"] == []


def test_a_leaked_block_shows(engine):
    """A block that no request holds but whose ref count says in use (a bug) is painted as in use."""
    pool = engine.kv_cache_manager.block_pool
    pool.free_block_queue.remove(pool.blocks[7])
    pool.blocks[7].ref_cnt = 1
    snap = kv_snapshot(engine)
    assert snap["pool"]["used"] == 1 and snap["block_states"][7] == "u" and snap["requests"] == []


def test_render_svg_png_and_watch(engine, tmp_path):
    engine.add_request("A", A, greedy(3))
    engine.step()
    engine.add_request("B", B, greedy(2))
    engine.step()
    snap = kv_snapshot(engine)
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(render(snap, 100))
    text = console.export_text()
    for words in ("32 blocks × 4 tokens", "5 blocks (15.6%", "2 of them shared", "0-1, 3-4", "most shared",
                  "free 27", "shared 2", "in use 3"):
        assert words in text, words
    save_svg(snap, str(tmp_path / "kv.svg"))
    root = ET.parse(tmp_path / "kv.svg").getroot()
    assert root.tag.endswith("svg") and "0-1,&#160;3-4" in (tmp_path / "kv.svg").read_text()
    pytest.importorskip("PIL")
    from pagedmlx.blocks.png import save_png

    save_png(snap, str(tmp_path / "kv.png"))
    assert (tmp_path / "kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    frames = []
    watch(lambda: frames.append(1) or kv_snapshot(engine), interval=0.01, console=console, iterations=2)
    assert len(frames) == 2


def test_big_pool_picture_groups_blocks():
    from pagedmlx.blocks.view import cell_states, grid_shape

    assert grid_shape(100_000, 100) == (64, 49)
    assert cell_states("..uu" + "sss." + "c...", 4) == ["u", "s", "."]  # ties go to the more active state
    assert cell_states("uucc", 4) == ["u"]


# ---- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed():
    from test_server import Served, make_engine

    s = Served(make_engine(), api_key="sekrit")
    yield s
    s.stop()


def test_endpoint_behind_api_key_and_back_to_zero(keyed):
    url = keyed.url + "/v1/engine/kv"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    keyed.client(api_key="sekrit").completions.create(model="tiny-llama", prompt="Hello, world! " * 4, max_tokens=3)
    r = httpx.get(url, headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    snap = r.json()
    assert snap["model"] == "tiny-llama" and snap["pool"]["num_blocks"] == 256
    assert snap["pool"]["used"] == 0 and snap["pool"]["cached_free"] >= 1 and snap["requests"] == []
    assert snap["prefix_cache"]["queries"] > 0 and len(snap["block_states"]) == 256


def test_cli_json_svg_png_against_a_server(keyed, capsys, tmp_path, monkeypatch):
    assert main(["blocks", "--url", keyed.url, "--api-key", "sekrit", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["pool"]["num_blocks"] == 256 and snap["model"] == "tiny-llama"
    monkeypatch.setenv("PAGEDMLX_API_KEY", "sekrit")
    assert main(["blocks", "--url", keyed.url + "/v1/", "--svg", str(tmp_path / "p.svg")]) == 0
    assert ET.parse(tmp_path / "p.svg").getroot().tag.endswith("svg")
    assert main(["blocks", "--url", keyed.url]) == 0
    assert "pagedmlx KV pool" in capsys.readouterr().out
    monkeypatch.delenv("PAGEDMLX_API_KEY")
    assert main(["blocks", "--url", keyed.url, "--json"]) == 1
    assert "401" in capsys.readouterr().err
    # The same view from the engine in this process, between its steps (AsyncEngine.call).
    assert get_snapshot(keyed.async_engine)["pool"]["num_blocks"] == 256
