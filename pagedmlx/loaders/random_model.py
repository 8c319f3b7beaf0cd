"""Random-weight models for tests, CI and demos: `--model random:llama-tiny` serves one with no
download. Tiny, float32 and deterministic: the same name gives the same weights and tokenizer."""

from __future__ import annotations

import functools

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

# Layers that need more than a plain KV cache (window 8: a few pages of 4 tokens in the tests).
# From shared/research/hybrid_token_major.py's configs.
_GEMMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, vocab_size=512,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True)
RANDOM_ARCHS.update({
    "gemma3-tiny": dict(model_type="gemma3_text", num_hidden_layers=6, num_key_value_heads=2, sliding_window=8,
                        sliding_window_pattern=3, **_GEMMA),
    # Gemma 4 "E" style: sliding + full layers of different head sizes, a KV-shared tail, per-layer inputs
    "gemma4-e-tiny": dict(model_type="gemma4_text", num_hidden_layers=6, global_head_dim=32, num_key_value_heads=1,
                          num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                          sliding_window=8, sliding_window_pattern=3, final_logit_softcapping=30.0,
                          use_double_wide_mlp=True, **_GEMMA),
    # Gemma 4 26B/31B style: K = V on full layers, separate global KV heads, a MoE block
    "gemma4-moe-tiny": dict(model_type="gemma4_text", num_hidden_layers=6, global_head_dim=32, num_key_value_heads=2,
                            num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
                            hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                            moe_intermediate_size=32, sliding_window=8, sliding_window_pattern=3,
                            final_logit_softcapping=30.0, use_double_wide_mlp=False, **_GEMMA),
    "gemma3n-tiny": dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", num_hidden_layers=6, num_key_value_heads=2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=512, sliding_window=8, rope_local_base_freq=10000.0, rope_theta=1000000.0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.95, 0, 0, 0, 0], hidden_size_per_layer_input=16, altup_num_inputs=4,
        altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=8, **_GEMMA)),
    # gpt-oss: alternating sliding / full layers, learned attention sinks (randomised below), MoE, YaRN
    "gpt-oss-tiny": dict(model_type="gpt_oss", num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                         vocab_size=512, rms_norm_eps=1e-5, hidden_size=64, intermediate_size=64, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=8, rope_theta=150000,
                         rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "original_max_position_embeddings": 4096},
                         layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere2-tiny": dict(model_type="cohere2", hidden_size=64, head_dim=16, num_hidden_layers=4,
                         intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         sliding_window=8, sliding_window_pattern=4),
    "olmo3-tiny": dict(model_type="olmo3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                       num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=512, max_position_embeddings=4096,
                       sliding_window=8, rope_theta=10000.0, num_key_value_heads=2,
                       layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "ministral3-tiny": dict(model_type="ministral3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                            head_dim=16, sliding_window=8, max_position_embeddings=4096,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.1,
                                             "original_max_position_embeddings": 4096},
                            layer_types=["sliding_attention", "full_attention"] * 2),
})

# Layers with a recurrent state beside (or instead of) attention, from the same prototype's configs:
# Gated DeltaNet (Qwen3.5 / 3.6, Qwen3-Next), short convolutions (LFM2), Mamba2 (Nemotron-H, Granite-4-H,
# Falcon-H1 with state and attention in one layer, Mamba2 alone).
_GDN = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=2, vocab_size=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096)
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
_MOE = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)
RANDOM_ARCHS.update({
    "qwen3_5-tiny": dict(model_type="qwen3_5", text_config=dict(model_type="qwen3_5_text", rope_parameters=_QWEN35_ROPE,
                                                                **_GDN)),
    "qwen3_5_moe-tiny": dict(model_type="qwen3_5_moe", text_config=dict(
        model_type="qwen3_5_moe_text", norm_topk_prob=True, rope_parameters=_QWEN35_ROPE, **_MOE, **_GDN)),
    "qwen3_next-tiny": dict(model_type="qwen3_next", mlp_only_layers=[], rope_theta=1e7, partial_rotary_factor=0.25,
                            **_MOE, **_GDN),
    "lfm2-tiny": dict(model_type="lfm2", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False,
                      conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                      block_auto_adjust_ff_dim=False, block_ff_dim=128, full_attn_idxs=[1, 3]),
    "nemotron_h-tiny": dict(model_type="nemotron_h", vocab_size=512, hidden_size=64, intermediate_size=128,
                            max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2,
                            attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                            ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5,
                            use_bias=False, use_conv_bias=True, hybrid_override_pattern="M-M*", num_hidden_layers=4,
                            head_dim=16),
    "granitemoehybrid-tiny": dict(
        model_type="granitemoehybrid", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
        embedding_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0, residual_multiplier=1.0,
        layer_types=["mamba", "attention"] * 2, rms_norm_eps=1e-5, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16,
        mamba_conv_bias=True, mamba_proj_bias=False, num_local_experts=0, num_experts_per_tok=0,
        shared_intermediate_size=128, position_embedding_type="rope", rope_theta=10000.0),
    "falcon_h1-tiny": dict(model_type="falcon_h1", vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                           mamba_d_conv=4, max_position_embeddings=4096),
    "mamba2-tiny": dict(model_type="mamba2", num_heads=4, head_dim=16, vocab_size=512, hidden_size=32,
                        intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
                        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                        time_step_limit=(0.0, float("inf")), time_step_rank=4),
})

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_model(arch: str, seed: int = 0) -> nn.Module:
    """A random-weight float32 mlx-lm model of one of RANDOM_ARCHS, seeded."""
    if arch not in RANDOM_ARCHS:
        raise ValueError(f"unknown random model {arch!r}; choose one of {', '.join(RANDOM_ARCHS)}")
    return build_model(RANDOM_ARCHS[arch], seed)


def build_model(cfg: dict, seed: int = 0) -> nn.Module:
    """A random-weight float32 mlx-lm model of any architecture from its config, seeded."""
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    # Larger-than-default weights make logits decisive, so greedy ties are not a matter of rounding.
    # Attention sinks start at zero in mlx-lm: random ones make a path that drops them give other tokens.
    model.update(tree_map_with_path(
        lambda path, p: mx.random.normal(p.shape) * 2.0 if path.endswith("sinks") else p * 2.0, model.parameters()))
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
    return model, tiny_tokenizer(vocab_size(RANDOM_ARCHS[arch]))


def vocab_size(cfg: dict) -> int:
    """A config's vocabulary size, at its top or in its text_config (qwen3_5, gemma3n)."""
    return cfg["vocab_size"] if "vocab_size" in cfg else cfg["text_config"]["vocab_size"]
