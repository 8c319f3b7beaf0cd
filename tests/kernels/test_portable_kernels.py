"""The paged kernels' one source, rendered for CUDA and Metal, checked without either GPU.

- Every dialect token is expanded and each backend's text names nothing of the other language.
- For every shape variant, the Metal source that MLX itself generates (signature and template
  instantiation included: MLX's CPU build prints it while an export traces the call) declares
  what the body uses.
- Both instantiations run on the CPU (tests/kernel_emulator: fibers for lanes, real SIMD-shuffle
  and barrier semantics) and match the gather path, windows, sinks and splits included.
- A numpy reference of the kernel's math (window, sinks, split-K partials and their merge)
  matches mx.fast.scaled_dot_product_attention.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import numpy as np
import pytest
from utils import fast_first
from kernel_emulator import EmulatedKernel, have_compiler, metal_source

from pagedmlx.kernels import add_rms_norm, build, decode_attention, page_write
from pagedmlx.kernels.sources import decode_attention as decode_source
from pagedmlx.runner.attention import gather_decode
from pagedmlx.runner.attention_metadata import length_mask
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens, render

# (dtype, head_dim, query heads, kv heads): MHA, GQA 4 (Llama), GQA 7 (Qwen), head_dim 64 and 256.
SHAPES = [(mx.bfloat16, 128, 32, 8), (mx.float16, 64, 8, 8), (mx.float32, 128, 28, 4), (mx.bfloat16, 256, 8, 2),
          (mx.float16, 128, 16, 2)]
FEATURES = [(None, False), (100, False), (None, True), (37, True)]  # (window, sinks)
ATTRIBUTES = ("thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
              "threadgroups_per_grid", "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup")


def all_sources() -> dict[str, str]:
    out = {}
    for backend in (CUDA, METAL):
        for mma in (False, True) if backend == CUDA else (False,):
            for kernel, (body, header) in decode_attention.decode_sources(backend, mma).items():
                out[f"{backend} {kernel}{' mma' if mma else ''}"] = header + body
        out[f"{backend} write"] = page_write.write_source(backend)
        out[f"{backend} add_rms_norm"] = add_rms_norm.add_rms_norm_source(backend)
    return out


def test_every_token_expands_and_no_name_of_the_other_language_is_left():
    for name, text in all_sources().items():
        backend = name.split()[0]
        assert not leftover_tokens(text), name
        if "mma" not in name:  # the tensor-core kernel is CUDA's own text; its PTX helpers name no Metal
            assert not foreign_names(text, backend), (name, foreign_names(text, backend))
        else:
            assert not foreign_names(text, CUDA) - {"asm"}, name


def test_the_checks_catch_what_they_look_for():
    assert foreign_names("x = __shfl_xor_sync(0xffffffff, y, 1);", METAL) == {"__shfl*"}
    assert foreign_names("threadgroup float a[4]; a[0] = metal::exp(b);", CUDA) == {"threadgroup*", "metal"}
    assert leftover_tokens("const int l = LANE;") == {"LANE"}
    with pytest.raises(ValueError, match="SHFL"):
        render("x = SHFL_XOR (y, 1);", METAL)  # a token the renderer does not recognise, left as is


def test_comments_are_dropped_so_mlx_sees_only_code():
    """MLX declares a Metal attribute (and an input's _shape) when its name appears anywhere in the
    body's text: a comment naming one would add a parameter."""
    text = render(decode_source.ACCUMULATE, METAL)
    assert "//" not in text and "/*" not in text


class RecordingKernel:
    """Stands in for a Metal kernel object: keeps the source MLX generates for each call."""

    def __init__(self, backend, name, input_names, output_names, source, header):
        self.args = (name, input_names, output_names, source, header)
        self.generated: list[tuple[str, dict]] = []

    def __call__(self, *, inputs, output_shapes, output_dtypes, **call):
        text = metal_source(*self.args, inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, **call)
        RECORDED.append((self.args, text, dict(call, inputs=inputs)))
        return [mx.zeros(s, dt) for s, dt in zip(output_shapes, output_dtypes)]


RECORDED: list = []


@pytest.fixture
def kernels(monkeypatch):
    """The kernels are built through `factory`."""
    def use(factory):
        monkeypatch.setattr(build, "make_kernel", factory)
        decode_attention._kernels.cache_clear()
        page_write._write_kernel.cache_clear()
    yield use
    decode_attention._kernels.cache_clear()
    page_write._write_kernel.cache_clear()


def random_case(rng, dtype, D, H, KV, lens, bs=16, extra_blocks=3):
    nb = -(-int(max(lens)) // bs)
    num_blocks = len(lens) * nb + extra_blocks
    k = mx.array(rng.standard_normal((num_blocks, KV, bs, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((num_blocks, KV, bs, D)).astype(np.float32)).astype(dtype)
    table = mx.array(rng.permutation(num_blocks)[: len(lens) * nb].reshape(len(lens), nb).astype(np.int32))
    q = mx.array(rng.standard_normal((len(lens), H, D)).astype(np.float32)).astype(dtype)
    sinks = mx.array(rng.standard_normal(H).astype(np.float32) * 2)
    return q, k, v, table, mx.array(np.asarray(lens, np.int32)), sinks


@pytest.mark.parametrize("dtype,D,H,KV", SHAPES)
def test_metal_signature_mlx_generates_declares_what_the_body_uses(kernels, dtype, D, H, KV):
    assert decode_attention.supports(D, H, KV, dtype, METAL)
    RECORDED.clear()
    kernels(RecordingKernel)
    rng = np.random.default_rng(0)
    q, k, v, table, lens, sinks = random_case(rng, dtype, D, H, KV, [3, 40])
    for window, with_sinks in FEATURES:
        for splits in (1, 3):
            decode_attention.paged_decode(q, k, v, table, lens, D ** -0.5, splits, mx.array([14], mx.int32),
                                       window=window, sinks=sinks if with_sinks else None, backend=METAL)
    page_write.reshape_and_cache(q[:, :KV, None, :], q[:, :KV, None, :], k, v, lens, backend=METAL)
    assert len(RECORDED) == 4 * (1 + 2) + 1  # single; split + merge
    for (name, input_names, output_names, body, header), text, call in RECORDED:
        signature = re.search(r"\[\[kernel\]\] void (\w+)\((.*?)\) \{", text, re.S)
        params = signature.group(2)
        for n in input_names + output_names:
            assert re.search(rf"\b{n} \[\[buffer\(\d+\)\]\]", params), (name, n)
        for shape in set(re.findall(r"\b(\w+)_shape\b", body)):
            assert shape in input_names and re.search(rf"\b{shape}_shape \[\[buffer", params), (name, shape)
        used = {a for a in ATTRIBUTES if re.search(rf"\b{a}\b", body)}
        declared = set(re.findall(r"\[\[(\w+)\]\]", params))
        assert used and used == declared, (name, used, declared)
        assert not {a for a in ATTRIBUTES if re.search(rf"\b{a}\b", header)}, (
            "attributes in the header are not declared")
        assert not foreign_names(text, METAL), (name, foreign_names(text, METAL))
        assert not leftover_tokens(text)
        values = [str(v).lower() if not isinstance(v, mx.Dtype) else None for _, v in call["template"]]
        inst = re.search(r"decltype\(\w+<(.*?)>\)", text).group(1).split(", ")
        assert [x for x, v in zip(inst, values) if v is not None] == [v for v in values if v is not None]
        # Pointers derived from an argument keep its address space: `auto`, or a type naming one.
        for decl in re.findall(r"\n\s*((?:const )?[\w:]+\s*\*\s*\w+\s*=)", body):
            assert re.search(r"\b(device|constant|thread|threadgroup)\b", decl), (name, decl)
        for cast in re.findall(r"(?:reinterpret|const)_cast<([^>]*)>", body + header):
            assert re.search(r"\b(device|constant|thread|threadgroup)\b", cast), (name, cast)


def test_metal_takes_only_groups_whose_partials_fit_32_kb_of_threadgroup_memory():
    assert decode_attention.supports(256, 16, 2, mx.bfloat16, CUDA)  # 4 x 8 x 258 floats: 33 KB of 48
    assert not decode_attention.supports(256, 16, 2, mx.bfloat16, METAL)
    assert decode_attention.supports(256, 8, 2, mx.bfloat16, METAL)


needs_compiler = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")
EMULATED = [(mx.bfloat16, 128, 8, 2, [1, 17, 70], 30), (mx.float16, 64, 4, 4, [5, 16, 33], 16),
            (mx.float32, 128, 14, 2, [9, 64], 7), (mx.bfloat16, 256, 4, 2, [40], 100)]


@needs_compiler
@pytest.mark.parametrize("backend", [METAL, CUDA])
@pytest.mark.parametrize("dtype,D,H,KV,lens,window", fast_first(1, EMULATED))
def test_emulated_kernels_match_the_gather_path(kernels, backend, dtype, D, H, KV, lens, window):
    """The MMA kernel is CUDA's own (PTX) and not emulated: the lanes kernel runs for CUDA here."""
    kernels(EmulatedKernel)
    settings = dataclasses.replace(decode_attention.SETTINGS[backend], mma=0)
    rng = np.random.default_rng(1)
    q, k, v, table, seq_lens, sinks = random_case(rng, dtype, D, H, KV, lens)
    f32 = (lambda x: x.astype(mx.float32))
    tol = {mx.float32: 1e-4, mx.float16: 5e-3, mx.bfloat16: 3e-2}[dtype]
    for w, with_sinks in [(None, False), (window, False), (None, True), (window, True)]:
        s = sinks if with_sinks else None
        want = gather_decode(f32(q), f32(k), f32(v), table, D ** -0.5,
                             length_mask(seq_lens, table.shape[1] * 16, w), s)
        span = min(max(lens), w or max(lens))
        for splits in (1, 3):
            tokens = -(-span // splits)
            got = decode_attention.paged_decode(q, k, v, table, seq_lens, D ** -0.5, -(-span // tokens),
                                             mx.array([tokens], mx.int32), window=w, sinks=s,
                                             init_value=float("nan"), settings=settings, backend=backend)
            err = mx.abs(f32(got) - want).max().item()
            assert np.isfinite(err) and err <= tol, (w, with_sinks, splits, err)


@needs_compiler
@pytest.mark.parametrize("backend", [METAL, CUDA])
def test_emulated_page_write_lands_in_place_and_skips_negative_slots(kernels, backend):
    kernels(EmulatedKernel)
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((4, 2, 8, 32)).astype(np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((4, 2, 8, 32)).astype(np.float32)).astype(mx.bfloat16)
    mx.eval(k, v)
    want_k, want_v = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    slots = np.array([5, -1, 31, 8, 17], np.int32)  # 5 x 2 x 32 threads: a partial group of 64 at the grid's edge
    keys = mx.array(rng.standard_normal((5, 2, 1, 32)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((5, 2, 1, 32)).astype(np.float32)).astype(mx.bfloat16)
    written = page_write.reshape_and_cache(keys, values, k, v, mx.array(slots), backend=backend)
    assert written.tolist() == [0]
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s // 8, :, s % 8] = np.array(keys[i, :, 0].astype(mx.float32))
            want_v[s // 8, :, s % 8] = np.array(values[i, :, 0].astype(mx.float32))
    assert np.array_equal(np.array(k.astype(mx.float32)), want_k)
    assert np.array_equal(np.array(v.astype(mx.float32)), want_v)


def reference_decode(q, k, v, lens, scale, window=None, sinks=None, split_tokens=None):
    """The kernels' math in numpy: per split, partials (running max m, sum l, weighted values a)
    over keys [lo + s * split_tokens, ...) with lo = len - window; then the merge with the sink.
    q (B, H, D), k / v (B, KV, S, D) contiguous, lens (B,)."""
    B, H, D = q.shape
    G = H // k.shape[1]
    out = np.zeros((B, H, D))
    for b in range(B):
        lo = max(0, lens[b] - window) if window else 0
        st = split_tokens or lens[b] - lo
        for h in range(H):
            parts = []
            for start in range(lo, lens[b], st):
                s = k[b, h // G, start:min(lens[b], start + st)] @ q[b, h] * scale
                m = s.max()
                p = np.exp(s - m)
                parts.append((m, p.sum(), p @ v[b, h // G, start:min(lens[b], start + st)]))
            M = max(m for m, _, _ in parts)
            L = sum(denom * np.exp(m - M) for m, denom, _ in parts)
            A = sum(a * np.exp(m - M) for m, _, a in parts)
            if sinks is not None:
                M2 = max(M, sinks[h])
                L, A = L * np.exp(M - M2) + np.exp(sinks[h] - M2), A * np.exp(M - M2)
            out[b, h] = A / L
    return out


@pytest.mark.parametrize("window,with_sinks,split_tokens", [(None, False, None), (None, False, 7), (12, False, 5),
                                                            (None, True, 9), (20, True, 6), (100, True, 4)])
def test_numpy_reference_of_window_sinks_and_split_merge_matches_sdpa(window, with_sinks, split_tokens):
    rng = np.random.default_rng(3)
    B, H, KV, S, D = 3, 6, 2, 45, 16
    q, k, v = (rng.standard_normal(shape) for shape in [(B, H, D), (B, KV, S, D), (B, KV, S, D)])
    lens = np.array([1, 30, 45])
    sinks = rng.standard_normal(H) * 2 if with_sinks else None
    got = reference_decode(q, k, v, lens, 0.25, window, sinks, split_tokens)
    mask = length_mask(mx.array(lens), S, window)
    want = mx.fast.scaled_dot_product_attention(
        mx.array(q[:, :, None, :], mx.float32), mx.array(k, mx.float32), mx.array(v, mx.float32), scale=0.25,
        mask=mask, sinks=None if sinks is None else mx.array(sinks, mx.float32))[:, :, 0, :]
    assert np.abs(got - np.array(want)).max() < 1e-5
