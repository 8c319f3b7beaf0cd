"""Random-weight models for tests, CI and demos: `--model random:llama-tiny` serves one with no
download. Tiny, float32 and deterministic: the same name gives the same weights and tokenizer."""

from __future__ import annotations

import functools
import importlib

import mlx.core as mx
import mlx.nn as nn

RANDOM_PREFIX = "random:"

RANDOM_ARCHS = {
    "llama-tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                       tie_word_embeddings=False),
    "llama-tiny-tied": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                            num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=384,
                            tie_word_embeddings=True),
    "qwen3-tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                       vocab_size=448, rope_theta=1_000_000.0, max_position_embeddings=4096,
                       tie_word_embeddings=True),
    "llama-small": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=512,
                        tie_word_embeddings=False),
}

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_model(arch: str, seed: int = 0) -> nn.Module:
    """A random-weight float32 mlx-lm model of one of RANDOM_ARCHS, seeded."""
    if arch not in RANDOM_ARCHS:
        raise ValueError(f"unknown random model {arch!r}; choose one of {', '.join(RANDOM_ARCHS)}")
    from mlx.utils import tree_map

    cfg = RANDOM_ARCHS[arch]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Larger-than-default weights make logits decisive, so greedy ties are not a matter of rounding.
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size: int = 512):
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
    if missing < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the base tokenizer ({tok.get_vocab_size()})")
    tok.add_tokens([f"<x{i}>" for i in range(missing)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=TINY_CHAT_TEMPLATE)
    return TokenizerWrapper(hf)


def load_random(name: str):
    """`random:<arch>` -> (model, tokenizer)."""
    arch = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    model = random_model(arch)
    return model, tiny_tokenizer(RANDOM_ARCHS[arch]["vocab_size"])
