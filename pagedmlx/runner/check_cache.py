"""Load-time checks that passed, kept on disk so that a second start of the same model here skips them.

A model's check (runner/selfcheck.py) proves that its paged forward gives mlx-lm's logits. The proof holds for
what it ran: these weights, this runner's setup (kernels, rewrites, block size), this pagedmlx source, these MLX
and mlx-lm versions, on this device. A pass is kept under a key of all of those and read back instead of running
again; anything that differs is another key, so it runs. Only models loaded from a name whose weights can be
identified (model_identity) are kept; PAGEDMLX_CHECK_CACHE=0 runs every check, as `pagedmlx doctor` does. A
compiled decode trace's proof (ModelRunner._prove_trace) is kept the same way, under the model check's key and
the trace's own.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Optional

from pagedmlx import envs
from pagedmlx.platform import cache_dir, device_name

_PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def source_digest() -> str:
    """A digest of every pagedmlx source file and tuned launch config (PAGEDMLX_TUNED_CONFIG_FOLDER's too): a pass
    proves nothing for other code or other launches."""
    from pagedmlx.kernels import launch_configs

    h = hashlib.sha256()
    configs = [path for folder in launch_configs.folders() for path in sorted(folder.glob("*.json"))]
    for path in [*sorted(_PACKAGE.rglob("*.py")), *configs]:
        h.update(path.name.encode() if path.suffix == ".json" else path.relative_to(_PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def model_identity(model: Optional[str], dtype: Optional[str], resolved: Optional[Path] = None) -> Optional[str]:
    """What names these weights: a seeded random or preset model's name and dtype, or the files behind a path
    (name, size, modification time). None where they cannot be named (a hub name not on disk)."""
    if model is not None and model.startswith(("random:", "preset:")):
        return f"{model}|{dtype}"
    path = resolved or (Path(model).expanduser() if model else None)
    if path is None or not path.exists():
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return f"{dtype}|" + json.dumps(stats)


def check_key(kind: str, *parts: Any) -> str:
    import mlx.core as mx
    import mlx_lm

    text = json.dumps([kind, source_digest(), mx.__version__, mlx_lm.__version__, str(mx.default_device()),
                       device_name(), *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / "checks" / f"{key}.passed"


def passed(key: Optional[str]) -> bool:
    return key is not None and envs.PAGEDMLX_CHECK_CACHE and _path(key).exists()


def kept(kind: str, run: Callable[[], Optional[str]], *parts: Any) -> Optional[str]:
    """run() (a load-time check: None if it passed, else why not), skipped where it passed before under
    check_key(kind, *parts); a pass is kept."""
    key = check_key(kind, *parts)
    if passed(key):
        return None
    why = run()
    if why is None:
        record_pass(key)
    return why


def record_pass(key: Optional[str]) -> None:
    if key is None or not envs.PAGEDMLX_CHECK_CACHE:
        return
    try:
        _path(key).parent.mkdir(parents=True, exist_ok=True)
        _path(key).touch()
    except OSError:  # a read-only cache: the check runs again next time
        pass


def runner_check_key(runner: Any, identity: Optional[str]) -> Optional[str]:
    """The key of a ModelRunner's model check: the weights and everything of the runner the check ran through."""
    if identity is None:
        return None
    from pagedmlx.kernels.fused_moe import min_tokens

    setup = (runner.block_size, runner.merges, runner.merged_groups, bool(runner.skinny), bool(runner.fused_norms),
             runner._head is not None, repr(runner.kernels), sorted(runner.kv_quant), runner.windows,
             bool(getattr(runner, "quantized_gemm", False)),
             min_tokens() if getattr(runner, "fused_moe", 0) else 0)  # the fused MoE's steps (0: none)
    return check_key("model", identity, *setup)


def trace_check_key(runner: Any, identity: Optional[str], trace_key: Optional[tuple]) -> Optional[str]:
    """The key of a compiled decode trace's proof (ModelRunner._prove_trace): the model check's, and the trace's
    own key but its pool (a number of this process); None for a trace of adapter slots (their weights change)."""
    base = runner_check_key(runner, identity)
    if base is None or trace_key is None or trace_key[3] is not None:
        return None
    return check_key("trace", base, *trace_key[:-1])
