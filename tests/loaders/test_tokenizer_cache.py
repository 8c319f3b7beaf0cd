"""loaders/tokenizer_cache.py: a folder's tokenizer read once, then unpickled while its files stay the same."""

from __future__ import annotations

import os

import mlx_lm.utils
import pytest

from pagedmlx.loaders import tokenizer_cache
from pagedmlx.loaders.random_model import tiny_tokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model"
    tiny_tokenizer(600)._tokenizer.save_pretrained(str(path))
    return path


def reads(monkeypatch) -> list:
    """Each read of a folder's tokenizer by mlx-lm, from now on."""
    calls = []
    real = mlx_lm.utils.load_tokenizer

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(mlx_lm.utils, "load_tokenizer", counted)
    return calls


def same(a, b) -> bool:
    text = "Hello, world: 12 + 30 = 42"
    return (a.encode(text) == b.encode(text) and a.eos_token_ids == b.eos_token_ids
            and a.apply_chat_template(MESSAGES, add_generation_prompt=True)
            == b.apply_chat_template(MESSAGES, add_generation_prompt=True))


def test_a_second_load_unpickles_the_first(folder, monkeypatch):
    calls = reads(monkeypatch)
    first = tokenizer_cache.load_tokenizer(folder, [2])
    second = tokenizer_cache.load_tokenizer(folder, [2])
    assert len(calls) == 1
    assert same(first, second) and same(second, mlx_lm.utils.load_tokenizer(folder, eos_token_ids=[2]))
    tokenizer_cache.load_tokenizer(folder, [3])  # other eos ids: another key
    assert len(calls) == 3


def test_changed_files_and_unreadable_pickles_are_read_again(folder, monkeypatch):
    calls = reads(monkeypatch)
    tokenizer_cache.load_tokenizer(folder)
    config = folder / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    tokenizer_cache.load_tokenizer(folder)
    assert len(calls) == 2
    for kept in (folder.parent / "cache" / "tokenizers").iterdir():
        kept.write_bytes(b"not a pickle")
    tok = tokenizer_cache.load_tokenizer(folder)
    assert len(calls) == 3 and same(tok, mlx_lm.utils.load_tokenizer(folder))


def test_off_keeps_nothing(folder, monkeypatch):
    monkeypatch.setenv("PAGEDMLX_TOKENIZER_CACHE", "0")
    calls = reads(monkeypatch)
    tokenizer_cache.load_tokenizer(folder)
    tokenizer_cache.load_tokenizer(folder)
    assert len(calls) == 2 and not (folder.parent / "cache" / "tokenizers").exists()
