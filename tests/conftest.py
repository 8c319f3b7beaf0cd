"""Shared fixtures: small random-weight float32 models of several mlx-lm architectures."""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

ARCHS = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                  tie_word_embeddings=False),
    "llama_tied": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                       num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=384,
                       tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  vocab_size=448, rope_theta=1_000_000.0, max_position_embeddings=4096,
                  tie_word_embeddings=True),
}


@functools.lru_cache(maxsize=None)
def make_model(arch: str, seed: int = 0):
    import importlib

    cfg = ARCHS[arch]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Larger-than-default weights make logits decisive, so greedy ties are not a matter of rounding.
    model.update(__import__("mlx.utils", fromlist=["tree_map"]).tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def solo_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own generation for one prompt alone: the reference every engine output must equal."""
    from mlx_lm.generate import generate_step

    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        out.append(int(tok))
    return out


def assert_no_leaks(engine) -> None:
    pool = engine.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks), [b for b in pool.blocks if b.ref_cnt]
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not engine.kv_cache_manager.req_to_blocks


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def smollm():
    """The real default model, SmolLM2-135M-Instruct (float32 on the CPU), fetched once and cached."""
    from pagedmlx.loader import load_model

    return load_model(None)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=None)
def make_tokenizer(vocab_size: int = 512):
    """A tiny real HF tokenizer (byte-level BPE trained here on a few sentences, a chat template,
    <|im_end|> as eos), padded with filler tokens to exactly `vocab_size` so that every id a
    random model samples decodes; wrapped in mlx-lm's TokenizerWrapper."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
             "Paged attention keeps the KV cache in fixed-size blocks.",
             "What is the capital of France? Paris is the capital of France."] * 8
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 320), special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    missing = vocab_size - tok.get_vocab_size()
    assert missing >= 0, (vocab_size, tok.get_vocab_size())
    tok.add_tokens([f"<x{i}>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TINY_CHAT_TEMPLATE)
    return TokenizerWrapper(hf)
