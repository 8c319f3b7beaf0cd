"""The prompts both benchmarks send: `random` (vLLM's random dataset: lengths drawn around
--random-input-len / --random-output-len, an optional shared prefix) and `sharegpt` (a ShareGPT-style
JSON file). One SampleRequest per request: its prompt, its length in tokens when known, and the
output length to ask for (max_tokens).

Random prompts are token ids drawn from the tokenizer's vocabulary less its special tokens. Without
a tokenizer the ids come from SAFE_TOKEN_IDS, 3 to 258, which every vocabulary this project has met
holds (byte-level BPE keeps its 256 byte tokens in the first few hundred ids, SentencePiece its byte
tokens at 3-258; bos / eos / pad mostly sit at 0-2): a server answers 400 to an id beyond its
vocabulary, so the range stays this small. Ids are drawn independently (vLLM takes consecutive ids
from a random offset); in a range this small, consecutive runs would make prompts share prefixes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

SAFE_TOKEN_IDS = (3, 259)  # [low, high): see the module docstring
WORDS = ("the of and to in is was for that with as on by at from his her an be which or are this had not "
         "but were have one their all its they been has who more when will would there time first after "
         "new two other some can also into only these over most may any city under then world year").split()


@dataclass
class SampleRequest:
    prompt: Union[str, list[int]]
    prompt_len: Optional[int]  # tokens; None when no tokenizer counted them (the server's usage will)
    expected_output_len: int


def load_tokenizer(name: str) -> Any:
    """A tokenizer by name: `random:<arch>` (pagedmlx's random models' tiny tokenizer), else a local
    folder or hub name through transformers' AutoTokenizer."""
    from pagedmlx.loaders.random_model import RANDOM_ARCHS, RANDOM_PREFIX, tiny_tokenizer

    if name.startswith(RANDOM_PREFIX):
        return tiny_tokenizer(RANDOM_ARCHS[name[len(RANDOM_PREFIX):]]["vocab_size"])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _hf(tokenizer: Any) -> Any:
    """The HF tokenizer inside mlx-lm's TokenizerWrapper (an HF one has a `_tokenizer` too: the Rust one)."""
    return tokenizer._tokenizer if type(tokenizer).__name__ == "TokenizerWrapper" else tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(_hf(tokenizer).encode(text, add_special_tokens=False))


def allowed_token_ids(tokenizer: Any = None, vocab_size: Optional[int] = None) -> np.ndarray:
    """The ids random prompts are drawn from: the vocabulary (its first `vocab_size` ids, when given)
    less the special tokens; SAFE_TOKEN_IDS without a tokenizer."""
    if tokenizer is None:
        return np.arange(*SAFE_TOKEN_IDS)
    hf = _hf(tokenizer)
    size = len(hf) if vocab_size is None else min(len(hf), vocab_size)
    return np.setdiff1d(np.arange(size), np.asarray(hf.all_special_ids or [], dtype=np.int64))


def printable_ids(tokenizer: Any, ids: np.ndarray) -> np.ndarray:
    """The ids that decode alone to text without a replacement character (not a piece of a UTF-8
    character): text made of them re-encodes to about as many tokens."""
    texts = _hf(tokenizer).batch_decode([[int(i)] for i in ids])
    keep = np.asarray([bool(t) and "\ufffd" not in t for t in texts])
    return ids[keep] if keep.any() else ids


def sample_lengths(mean: int, range_ratio: float, num: int, rng: np.random.Generator, minimum: int = 0) -> np.ndarray:
    """`num` integer lengths, uniform in [floor(mean * (1 - r)), ceil(mean * (1 + r))] (vLLM's)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(minimum, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0, tokenizer: Any = None, vocab_size: Optional[int] = None,
                    as_text: bool = False) -> list[SampleRequest]:
    """vLLM's random dataset. Prompts are exactly prefix_len + the drawn length token ids; with
    `as_text` they are text instead: the tokenizer's decoding of such ids, re-encoded and adjusted
    (as vLLM does) so that it is that many tokens when the tokenizer round-trips, or, without a
    tokenizer, that many plain words (about as many tokens; the server's usage counts them)."""
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng, minimum=1)
    if prefix_len + input_lens.min(initial=1) < 1:
        raise ValueError("random prompts would be empty: raise --random-input-len or --random-prefix-len")
    if as_text and tokenizer is None:
        words = np.asarray(WORDS)
        prefix = " ".join(rng.choice(words, prefix_len))
        return [SampleRequest(" ".join(filter(None, [prefix, *rng.choice(words, int(n))])), None, int(m))
                for n, m in zip(input_lens, output_lens)]
    allowed = allowed_token_ids(tokenizer, vocab_size)
    if as_text:
        allowed = printable_ids(tokenizer, allowed)
    prefix_ids = rng.choice(allowed, prefix_len).tolist()
    out = []
    for n, m in zip(input_lens, output_lens):
        ids = prefix_ids + rng.choice(allowed, int(n)).tolist()
        if as_text:
            text, ids = text_of_length(tokenizer, ids, len(ids), allowed, rng)
            out.append(SampleRequest(text, len(ids), int(m)))
        else:
            out.append(SampleRequest(ids, len(ids), int(m)))
    return out


def text_of_length(tokenizer: Any, ids: list[int], target: int, allowed: np.ndarray, rng: np.random.Generator,
                   tries: int = 10) -> tuple[str, list[int]]:
    """(text, its token ids): decoding `ids` may re-encode to another count (merges across the
    seams), so cut or extend and decode again, a few times; the last try stands, near the target."""
    hf = _hf(tokenizer)
    for _ in range(tries):
        text = hf.decode(ids)
        again = encode(tokenizer, text)
        if len(again) == target:
            break
        ids = again[:target] if len(again) > target else again + rng.choice(allowed, target - len(again)).tolist()
    return text, again


def sharegpt_requests(path: str, num_prompts: int, seed: int = 0, tokenizer: Any = None,
                      output_len: Optional[int] = None, as_ids: bool = False) -> list[SampleRequest]:
    """ShareGPT-style JSON: a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    ...}, ...]}. Each conversation gives its first human turn as the prompt and the reply's length in
    tokens as max_tokens (or `output_len`). As vLLM: shuffled by `seed`, pairs under 4 tokens, prompts
    over 1,024 and pairs over 2,048 tokens left out, drawn again at random when too few remain.
    Without a tokenizer, lengths are estimated at 4 characters a token. `as_ids`: prompts as token ids."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path {path}: cannot read a ShareGPT JSON file ({exc})") from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations, got "
                         f"{type(data).__name__}")
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    for i in rng.permutation(len(pairs)):
        if len(out) == num_prompts:
            break
        prompt, reply = pairs[i]
        ids = encode(tokenizer, prompt) if tokenizer is not None else None
        prompt_len = len(ids) if ids is not None else math.ceil(len(prompt) / 4)
        reply_len = output_len or (len(encode(tokenizer, reply)) if tokenizer is not None
                                   else math.ceil(len(reply) / 4))
        if (prompt_len < 4 or (output_len is None and reply_len < 4) or prompt_len > 1024
                or prompt_len + reply_len > 2048):
            continue
        out.append(SampleRequest(ids if as_ids and ids is not None else prompt,
                                 prompt_len if ids is not None else None, reply_len))
    if not out:
        raise ValueError(f"{path}: no conversation with a human turn and a reply of usable length")
    if len(out) < num_prompts:
        out += [out[i] for i in rng.integers(0, len(out), num_prompts - len(out))]
    return out


def _first_exchange(entry: Any) -> Optional[tuple[str, str]]:
    turns = entry.get("conversations") or entry.get("conversation") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turns[i + 1], dict):
            prompt, reply = turn.get("value"), turns[i + 1].get("value")
            if isinstance(prompt, str) and isinstance(reply, str) and prompt:
                return prompt, reply
    return None


def check_dataset_args(args: Any) -> None:
    """The dataset options that can be refused before a model loads or a server is asked (ValueError)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        if not os.path.isfile(args.dataset_path):
            raise ValueError(f"--dataset-path {args.dataset_path}: no such file")


def get_samples(args: Any, tokenizer: Any = None, chat: bool = False, as_ids: bool = False,
                vocab_size: Optional[int] = None) -> list[SampleRequest]:
    """The requests `args` (the dataset options of either command) ask for. Random prompts are token
    ids, exactly as long as asked, except for the chat endpoint and with `args.text_prompts` (servers
    that take only text): then text (see random_requests). ShareGPT prompts are text, or with
    `as_ids` (offline) their token ids."""
    check_dataset_args(args)
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, tokenizer,
                                 args.sharegpt_output_len, as_ids=as_ids and not chat)
    as_text = chat or (getattr(args, "text_prompts", False) and not as_ids)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           args.random_prefix_len, args.seed, tokenizer, vocab_size, as_text=as_text)
