"""A model folder's tokenizer kept on disk, pickled as the engine-core process hands it to the server's front end.

mlx-lm reads a folder's tokenizer.json three times over (its own json.load, then transformers twice): about a
third of a second for SmolLM2's 3.5 MB on a CPU core, on the critical path of every start. A second start of the
same folder unpickles the tokenizer the first one read, in about a third of that. A tokenizer is kept under the
folder's files (name, size, modification time), the eos ids it was read with and the versions of Python, mlx-lm,
transformers and tokenizers: anything else is another key, read as mlx-lm reads it. A file that does not read
back is read again from the folder. PAGEDMLX_TOKENIZER_CACHE=0 keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagedmlx import envs
from pagedmlx.platform import cache_dir

logger = logging.getLogger("pagedmlx")


def load_tokenizer(folder: Path, eos_token_ids: Any = None) -> Any:
    """mlx_lm.utils.load_tokenizer(folder, eos_token_ids=...), or the one a start before read from the same files."""
    from mlx_lm.utils import load_tokenizer as read_tokenizer

    if not envs.PAGEDMLX_TOKENIZER_CACHE:
        return read_tokenizer(folder, eos_token_ids=eos_token_ids)
    path = cache_dir() / "tokenizers" / f"{_key(folder, eos_token_ids)}.pickle"
    try:
        with open(path, "rb") as f:
            tokenizer = pickle.load(f)
        logger.info("the tokenizer an earlier start read from this folder was kept: not read again")
        return tokenizer
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001 - a file cut short or from other code: read the folder instead
        logger.debug("the kept tokenizer %s did not read back", path, exc_info=True)
    tokenizer = read_tokenizer(folder, eos_token_ids=eos_token_ids)
    _keep(tokenizer, path)
    return tokenizer


def _key(folder: Path, eos_token_ids: Any) -> str:
    import mlx_lm
    import tokenizers
    import transformers

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    versions = [sys.version_info[:2], mlx_lm.__version__, transformers.__version__, tokenizers.__version__]
    text = json.dumps([stats, eos_token_ids, versions], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _keep(tokenizer: Any, path: Path) -> None:
    """Write the tokenizer where the next start reads it (whole or not at all); nothing where that fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception:  # noqa: BLE001 - a read-only cache, a tokenizer that does not pickle: read it next time too
        logger.debug("the tokenizer was not kept at %s", path, exc_info=True)
