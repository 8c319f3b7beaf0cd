"""Rebuild a Hugging Face tokenizer from the tokenizer.ggml.* metadata of a GGUF file: byte-level BPE
(`gpt2`: SmolLM2, Llama 3, ...) or SentencePiece BPE (`llama`: Gemma)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# llama.cpp's token_type values (gguf.TokenType)
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4

# The Llama 3 split pattern, which llama.cpp applies for tokenizer.ggml.pre == "llama-bpe".
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPACE = "\u2581"  # SentencePiece's visible space


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


def _byte_level_bpe(metadata: dict[str, Any]) -> tuple[Tokenizer, Callable]:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [_split_merge(m) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre_tokenizer, ignore_merges = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt2"))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok, BPEStreamingDetokenizer


def _score_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges pieces by the score of the piece they make, best first; a GGUF keeps
    those scores and no merges. Every split of a normal piece into two vocabulary pieces is a merge
    ranked by that piece's score, as Hugging Face's SentencePiece converter derives them. (Where two
    splits of one piece overlap in a text, "ab|a" and "a|ba", SentencePiece takes the leftmost and a
    merge list cannot say so; Hugging Face's Gemma tokenizers share that.)"""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(metadata: dict[str, Any]) -> tuple[Tokenizer, Callable]:
    """Gemma's tokenizer: spaces become "▁", no prefix space, BPE with byte fallback (<0xXX> pieces),
    as Hugging Face's GemmaTokenizer. Added tokens (control, user-defined) are matched first."""
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        raise ValueError("SentencePiece GGUF vocabularies that add a space prefix (Llama 2 style, "
                         "tokenizer.ggml.add_space_prefix) are not supported yet; Gemma's (no prefix) are")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = _score_merges(tokens, metadata["tokenizer.ggml.scores"], metadata["tokenizer.ggml.token_type"])
    unk = _token_id(metadata, "unknown")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                               byte_fallback=True, unk_token=None if unk is None else tokens[unk]))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, partial(SPMStreamingDetokenizer, trim_space=False)


# tokenizer.ggml.model -> (builder, whether llama.cpp adds BOS when the file does not say)
_MODELS = {"gpt2": (_byte_level_bpe, False), "llama": (_sentencepiece_bpe, True)}


def _token_id(metadata: dict[str, Any], key: str) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)


def build_tokenizer(metadata: dict[str, Any]) -> TokenizerWrapper:
    """A TokenizerWrapper around a PreTrainedTokenizerFast rebuilt from GGUF metadata (plain Python values)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', byte-level BPE, "
                         f"and 'llama', SentencePiece BPE)")
    build, bos_by_default = _MODELS[kind]
    tok, detokenizer_class = build(metadata)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )

    ids = {key: _token_id(metadata, key) for key in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", bos_by_default)) and ids["bos"] is not None
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
    return TokenizerWrapper(hf, detokenizer_class=detokenizer_class, eos_token_ids=eos_ids)
