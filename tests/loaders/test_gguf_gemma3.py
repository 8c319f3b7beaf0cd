"""gemma3 GGUF files written here as llama.cpp's converter writes them: mapped onto mlx-lm's gemma3_text
(norms stored as 1 + w, sliding layers, mixed quantized types), their SentencePiece tokenizer checked
against SentencePiece itself, and the loaded model through the engine."""

from __future__ import annotations

import io

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from gguf_utils import quantized_round_trip, randomize, shape_metadata, stream_decode, write_gguf
from utils import assert_no_leaks, assert_solo_greedy, run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.loaders.gguf import load_gguf
from pagedmlx.loaders.gguf_tokenizer import build_tokenizer
from pagedmlx.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
SPACE = "\u2581"

# A SentencePiece vocabulary as llama.cpp writes Gemma's: control tokens, user-defined ones (runs of
# spaces spelled with real spaces), 256 byte pieces, then normal pieces best first.
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "  "]
NORMAL = [SPACE, "t", "h", "e", f"{SPACE}t", "he", f"{SPACE}the"]
TOKENS = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + NORMAL
TYPES = [3] * 6 + [4] * 2 + [6] * 256 + [1] * len(NORMAL)
SCORES = [-1000.0] * 8 + [0.0] * 256 + [-float(i) for i in range(len(NORMAL))]


def tokenizer_metadata(tokens=TOKENS, types=TYPES, scores=SCORES) -> dict:
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False}


def _args(pattern: int) -> gemma3_text.ModelArgs:
    return gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                                 vocab_size=len(TOKENS), query_pre_attn_scalar=32, sliding_window=8,
                                 sliding_window_pattern=pattern, max_position_embeddings=1024)


GEMMA3_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
# Mixed types, as in a Q4_K_M file (K-quants need rows of 256 values; these rows have 64 or 128).
QTYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "ffn_gate": Q.Q5_0,
          "ffn_up": Q.Q5_0, "ffn_down": Q.Q4_1}


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, *module, leaf = name.split(".")
        return f"blk.{layer}.{GEMMA3_NAMES['.'.join(module)]}.{leaf}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]


def _qtype(gguf_name: str):
    return QTYPES.get(gguf_name.split(".")[-2]) if gguf_name.startswith("blk.") else QTYPES.get(gguf_name[:-7])


def write_gemma3(path, model, args, pattern_key: bool, norm_shift: float = 1.0) -> None:
    """What convert_hf_to_gguf.py's Gemma3Model writes: every norm weight + 1, no q/k permutation."""
    metadata = {**shape_metadata(args, "gemma3"), **tokenizer_metadata(),
                "gemma3.attention.key_length": args.head_dim, "gemma3.attention.value_length": args.head_dim,
                "gemma3.attention.sliding_window": args.sliding_window}
    if pattern_key:  # newer files may say which layers slide; llama.cpp's gemma3 default is every 6th global
        metadata["gemma3.attention.sliding_window_pattern"] = [
            (i + 1) % args.sliding_window_pattern != 0 for i in range(args.num_hidden_layers)]
    tensors = []
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value, dtype=np.float32) + (norm_shift if name.endswith("norm.weight") else 0.0)
        tensors.append((_gguf_name(name), w, _qtype(_gguf_name(name))))
    write_gguf(path, "gemma3", metadata, tensors)


def _reference(args, stored: bool = False) -> gemma3_text.Model:
    """Seeded random weights, tied embeddings as Gemma 3; stored: the values the file's types hold."""
    model = gemma3_text.Model(args)
    model.sanitize({})
    randomize(model)
    if stored:
        quantized = [(n, quantized_round_trip(p, _qtype(_gguf_name(n)))) for n, p in tree_flatten(model.parameters())
                     if _qtype(_gguf_name(n))]
        model.load_weights(quantized, strict=False)
    return model


PROMPT = mx.array([[2, 270, 265, 264, 269, 5, 6, 7, 8, 9, 10, 270, 268, 266, 40, 41, 42, 43, 44, 45]])  # > window


@pytest.mark.parametrize("pattern,pattern_key", [(6, False), (3, True)])
def test_gemma3_gguf_equals_gemma3_text(tmp_path, pattern, pattern_key):
    args = _args(pattern)
    ref = _reference(args)
    write_gemma3(tmp_path / "g.gguf", ref, args, pattern_key)
    model, _ = load_gguf(tmp_path / "g.gguf")
    assert isinstance(model, gemma3_text.Model) and "lm_head" not in model and model.tie_word_embeddings
    got = model.args
    assert (got.sliding_window, got.sliding_window_pattern, got.head_dim) == (8, pattern, 32)
    assert (got.rope_theta, got.rope_local_base_freq, got.query_pre_attn_scalar) == (1e6, 1e4, 32)
    caches = make_prompt_cache(model)
    assert [type(c) for c in caches] == [KVCache if (i + 1) % pattern == 0 else RotatingKVCache for i in range(6)]
    assert mx.abs(model(PROMPT) - _reference(args, stored=True)(PROMPT)).max().item() <= 1e-4


def test_gemma3_norms_are_shifted_back(tmp_path):
    """Negative control: a file whose norms lack llama.cpp's + 1 gives other logits."""
    args = _args(6)
    ref = _reference(args)
    write_gemma3(tmp_path / "g.gguf", ref, args, pattern_key=False, norm_shift=0.0)
    model, _ = load_gguf(tmp_path / "g.gguf")
    assert mx.abs(model(PROMPT) - _reference(args, stored=True)(PROMPT)).max().item() > 1e-2


def test_gemma3_irregular_sliding_layers_refused(tmp_path):
    args = _args(3)
    # Layers 0 and 3 global is not "every N-th".
    meta = {**shape_metadata(args, "gemma3"), **tokenizer_metadata(), "gemma3.attention.sliding_window": 8,
            "gemma3.attention.key_length": 32, "gemma3.attention.sliding_window_pattern": [False, True, True] * 2}
    tensors = [(_gguf_name(n), np.array(p, np.float32), None) for n, p in tree_flatten(_reference(args).parameters())]
    write_gguf(tmp_path / "odd.gguf", "gemma3", meta, tensors)
    with pytest.raises(ValueError, match="each N-th"):
        load_gguf(tmp_path / "odd.gguf")


def test_gemma3_gguf_through_the_engine(tmp_path):
    """The loaded model on pages: windows slide, tokens equal mlx-lm's generate_step."""
    args = _args(3)
    write_gemma3(tmp_path / "g.gguf", _reference(args), args, pattern_key=True)
    model, tok = load_gguf(tmp_path / "g.gguf")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=24))
    assert [g.name for g in engine.runner.kv_cache_config.kv_cache_groups] == ["full", "sliding 8"]
    rng = np.random.default_rng(0)
    prompts = [[2, *rng.integers(264, len(TOKENS), n).tolist()] for n in (5, 13, 30, 41)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    done = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)].token_ids, model, p, 10, i)
    assert_no_leaks(engine)


# ---------------------------------------------------------------- the tokenizer


def test_sentencepiece_tokenizer_pieces_and_bos():
    tok = build_tokenizer(tokenizer_metadata())
    ids = tok.encode("the the  the\nx")
    assert ids[0] == 2 and ids.count(2) == 1  # <bos>, once
    assert tok.convert_ids_to_tokens(ids[1:]) == ["t", "he", f"{SPACE}the", "  ", "t", "he", "\n", "<0x78>"]
    assert tok.decode(ids, skip_special_tokens=True) == "the the  the\nx"
    assert tok.encode("<start_of_turn>the") == [2, 4, *tok.encode("the", add_special_tokens=False)]
    assert tok.eos_token_ids == {1}


def test_sentencepiece_with_space_prefix_refused():
    with pytest.raises(ValueError, match="add_space_prefix"):
        build_tokenizer({**tokenizer_metadata(), "tokenizer.ggml.add_space_prefix": True})


CORPUS = """Paged attention keeps every sequence's keys and values in fixed-size blocks.
A sliding-window layer attends only to the last 512 tokens, so its older blocks go back to the pool.
Gemma 3 alternates five local layers with one global layer;  its vocabulary has 262,144 pieces.
    Indented code:\tdef f(x):\n        return x ** 2  # 2025
Unicode: café, naïve, Ωμέγα, Straße, 日本語, emoji 🙂👍🏽.
<table><tr><td>cell</td></tr></table>
""".splitlines()

TEXTS = [*CORPUS, "the   quick\n\n\nbrown  fox", "  leading", "trailing   ", "unseen: ßœ∑ ☃ 𝔘", "x" * 40,
         "12345 67"]


def _sentencepiece_model():
    """A SentencePiece BPE model trained like Gemma's (identity normalizer, no prefix space, byte
    fallback, user-defined runs of spaces and newlines), and its vocabulary as llama.cpp writes it."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=buf, model_type="bpe", vocab_size=600, byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        user_defined_symbols=["<start_of_turn>", "\n", "\n\n", SPACE * 2, SPACE * 3, "<table>"],
        hard_vocab_limit=False, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buf.getvalue())
    # llama.cpp: added tokens become control (special) or user-defined (with real spaces), score -1000
    user = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    tokens = [p.piece.replace(SPACE, " ") if p.type == user else p.piece for p in proto.pieces]
    types = [3 if p.type == 2 else p.type for p in proto.pieces]
    scores = [-1000.0 if p.type in (2, 3, user) else p.score for p in proto.pieces]
    return spm.SentencePieceProcessor(model_proto=buf.getvalue()), tokenizer_metadata(tokens, types, scores)


def test_sentencepiece_tokenizer_equals_sentencepiece():
    sp, metadata = _sentencepiece_model()
    tok = build_tokenizer(metadata)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), (text, tok.convert_ids_to_tokens(ids), sp.encode(text, out_type=str))
        assert tok.decode(ids) == text and stream_decode(tok, ids) == text
