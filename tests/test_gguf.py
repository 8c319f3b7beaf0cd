"""GGUF loading: tokenizer rebuilt from metadata, weight mapping and q/k un-permutation, the default model."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.llama import Model, ModelArgs

from pagedmlx.loader import load_model, model_name
from pagedmlx.models import default_model
from pagedmlx.models.gguf import load_gguf
from pagedmlx.models.gguf_tokenizer import build_tokenizer

# ---------------------------------------------------------------- the real default model (SmolLM2)

ROUND_TRIP = [
    "Hello world 2025!",
    "def square(x):\n    return x ** 2  # 2025\n\n\tindented\ttabs\r\n",
    "café, naïve, Ωμέγα, Straße, 日本語",
    "emoji 🙂👍🏽 and 🇫🇷",
    "  leading and trailing spaces  ",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm_round_trip(smollm, text):
    tok = smollm[1]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    # mlx-lm's BPE streaming detokenizer drops the text's first leading space (as for mlx_lm.load models)
    assert detok.text == (text[1:] if text.startswith(" ") else text)


def test_smollm_pinned_ids(smollm):
    tok = smollm[1]
    ids = tok.encode("Hello world 2025!")
    assert tok.convert_ids_to_tokens(ids) == ["Hello", "Ġworld", "Ġ", "2", "0", "2", "5", "!"]
    assert ids == [19556, 905, 216, 34, 32, 34, 37, 17]


def test_smollm_special_tokens(smollm):
    tok = smollm[1]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids[-1] == tok.eos_token_id == 2
    assert tok.eos_token_ids == {2}
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_smollm_answers_paris(smollm):
    model, tok = smollm
    assert model.model.embed_tokens.weight.dtype == mx.float32
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=20):
        if int(token) in tok.eos_token_ids:
            break
        out.append(int(token))
    assert "Paris" in tok.decode(out)


# ---------------------------------------------------------------- tiny GGUF files written here


def _byte_alphabet() -> list[str]:
    # GPT-2's printable stand-ins for the 256 byte values.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TINY_MERGES = ["h e", "l l", "Ġ w", "Ġw o"]
TINY_TOKENS = ["<s>", "</s>", *_byte_alphabet(), "he", "ll", "Ġw", "Ġwo"]


def _tiny_args(tied: bool) -> ModelArgs:
    return ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=len(TINY_TOKENS),
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )


def _random_model(args: ModelArgs) -> Model:
    mx.random.seed(0)
    model = Model(args)
    # Norm weights are ones at init; make them distinct so a swapped norm would show.
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.2 + (p.ndim == 1), model.parameters()))
    mx.eval(model.parameters())
    return model


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to q and k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in top or name == "lm_head.weight":
        return top.get(name, "output.weight")
    _, _, layer, *module, leaf = name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{leaf}"


def _write_gguf(path: Path, model: Model, args: ModelArgs, arch: str = "llama", qtype=None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_vocab_size(args.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3, 3] + [1] * (len(TINY_TOKENS) - 2))
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    heads = {"q_proj": args.num_attention_heads, "k_proj": args.num_key_value_heads}
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value, dtype=np.float32)
        module = name.split(".")[-2]
        if module in heads:
            w = _llamacpp_permute(w, heads[module])
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TOKENS = mx.array([[0, 5, 70, 260, 258, 33, 100, 200, 12, 261, 9, 1]])


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_f32_logits_identical(tmp_path, tied):
    args = _tiny_args(tied)
    ref = _random_model(args)
    _write_gguf(tmp_path / "tiny.gguf", ref, args)
    model, _ = load_gguf(tmp_path / "tiny.gguf")
    assert model.args.tie_word_embeddings == tied
    assert ("lm_head" in model) == (not tied)
    diff = mx.abs(model(TOKENS) - ref(TOKENS)).max().item()
    assert diff <= 1e-6


def test_tiny_q4_1_dequantized_and_packed(tmp_path):
    args = _tiny_args(tied=False)
    ref = _random_model(args)
    _write_gguf(tmp_path / "q.gguf", ref, args, qtype=gguf.GGMLQuantizationType.Q4_1)
    # Q4_1 blocks never straddle rows, so quantizing permuted rows = permuting quantized rows.
    q41 = gguf.GGMLQuantizationType.Q4_1

    def round_trip(p):
        return mx.array(gguf.quants.dequantize(gguf.quants.quantize(np.array(p), q41), q41)) if p.ndim == 2 else p

    ref.update(tree_map(round_trip, ref.parameters()))
    expected = ref(TOKENS)
    dequantized, _ = load_gguf(tmp_path / "q.gguf", quantized=False)
    assert mx.abs(dequantized(TOKENS) - expected).max().item() <= 1e-5
    packed, _ = load_gguf(tmp_path / "q.gguf", dtype=mx.float32, quantized=True)
    assert packed.model.layers[0].self_attn.q_proj.bits == 4
    assert mx.abs(packed(TOKENS) - expected).max().item() <= 1e-4


def test_tiny_tokenizer(tmp_path):
    args = _tiny_args(tied=True)
    _write_gguf(tmp_path / "tiny.gguf", _random_model(args), args)
    _, tok = load_gguf(tmp_path / "tiny.gguf")
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["he", "ll", "o", "Ġwo", "r", "l", "d"]
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("<s>hi</s>"), skip_special_tokens=True) == "hi"


def test_non_llama_architecture_refused(tmp_path):
    args = _tiny_args(tied=True)
    _write_gguf(tmp_path / "qwen.gguf", _random_model(args), args, arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        load_gguf(tmp_path / "qwen.gguf")


def test_unreadable_quantization_named(tmp_path):
    args = _tiny_args(tied=True)
    _write_gguf(tmp_path / "q5.gguf", _random_model(args), args, qtype=gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match="Q5_0"):
        load_gguf(tmp_path / "q5.gguf")


def test_unknown_pre_tokenizer_refused():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "falcon", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="pre-tokenizer 'falcon'"):
        build_tokenizer(meta)


# ---------------------------------------------------------------- loader and cache folder


def test_missing_gguf_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"))


def test_model_name():
    assert model_name(None) == "SmolLM2-135M-Instruct"
    assert model_name("/models/Foo-1B.Q8_0.gguf") == "Foo-1B.Q8_0"
    assert model_name("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"


def test_cache_dir_and_cached_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDMLX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "xdg" / "pagedmlx"
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "mine"))
    cached = tmp_path / "mine" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir()
    cached.write_bytes(b"placeholder")
    # A cached file is used as is: no download, no network.
    monkeypatch.setattr(default_model, "_download", lambda target: pytest.fail("downloaded"))
    assert default_model.default_model_path() == cached
