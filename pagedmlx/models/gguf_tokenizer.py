"""Rebuild a Hugging Face byte-level BPE tokenizer from the tokenizer.ggml.* metadata of a GGUF file."""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# llama.cpp's token_type values (gguf.TokenType)
_CONTROL = 3
_USER_DEFINED = 4

# The Llama 3 split pattern, which llama.cpp applies for tokenizer.ggml.pre == "llama-bpe".
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> tuple[Any, bool]:
    """The pre-tokenizer for a tokenizer.ggml.pre name, and whether BPE should ignore merges."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        return byte_level, False
    if pre == "smollm":
        # Every digit is its own pre-token, then the usual GPT-2 split (as SmolLM2's tokenizer.json).
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level]), False
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), "isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex]), True
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: 'smollm', 'gpt2', 'llama-bpe')")


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from index 1, as llama.cpp does, so that a piece starting with a space stays whole.
    i = merge.index(" ", 1)
    return merge[:i], merge[i + 1 :]


def _token_id(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)


def build_tokenizer(metadata: dict[str, Any]) -> TokenizerWrapper:
    """A TokenizerWrapper around a PreTrainedTokenizerFast rebuilt from GGUF metadata (plain Python values)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is supported)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [_split_merge(m) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre_tokenizer, ignore_merges = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt2"))

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )

    ids = {key: _token_id(metadata, key) for key in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and ids["bos"] is not None
    if add_bos:
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, ids["bos"])]
        )

    named = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    special = {name: tokens[ids[key]] for name, key in named.items() if ids[key] is not None}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        add_bos_token=add_bos,
        **special,
    )
    eos_ids = [ids[key] for key in ("eos", "eot", "eom") if ids[key] is not None]
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=eos_ids)
