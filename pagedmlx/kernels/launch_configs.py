"""Launch shapes tuned on a device and kept with the package, as vLLM keeps its fused-MoE kernel configs: a JSON file
per kernel and device in kernels/configs/, written by the kernel's bench (scripts/bench/bench_quantized_gemm.py
--sweep --write-config) on that device. A kernel reads the file for this process's GPU by its name (mx.device_info's
device_name), else one tuned on a GPU of the same compute capability, else none and keeps its own rules. A folder
named by PAGEDMLX_TUNED_CONFIG_FOLDER is searched the same way first.

What a file holds is each kernel's business (quantized_gemm.py: a launch per weight shape and row count); a tuned
launch runs only after the same load-time check as any other. PAGEDMLX_TUNED_CONFIGS=0 reads none (comparisons).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.platform import device_name

CONFIG_DIR = Path(__file__).parent / "configs"


def device() -> Optional[tuple[str, str]]:
    """(device name, compute capability 'X.Y') of this process's CUDA GPU; None elsewhere."""
    if mx.default_device() != mx.gpu:
        return None
    info = mx.device_info()
    if "compute_capability_major" not in info:  # Metal
        return None
    return device_name(), f"{info['compute_capability_major']}.{info['compute_capability_minor']}"


def file_name(kernel: str, device_name: str) -> str:
    """kernels/configs/<kernel>-<device name, spaces and punctuation as underscores>.json"""
    return f"{kernel}-{re.sub(r'[^A-Za-z0-9.]+', '_', device_name).strip('_')}.json"


@functools.lru_cache(maxsize=None)
def load(kernel: str) -> dict[str, Any]:
    """The tuned config of `kernel` for this process's device ({} where there is none)."""
    dev = device()
    if dev is None or not envs.PAGEDMLX_TUNED_CONFIGS:
        return {}
    return next((config for folder in folders() if (config := find(kernel, *dev, folder))), {})


def folders() -> list[Path]:
    """Where tuned configs are read, first match first: PAGEDMLX_TUNED_CONFIG_FOLDER, then the package's own."""
    extra = envs.PAGEDMLX_TUNED_CONFIG_FOLDER
    return [Path(extra).expanduser(), CONFIG_DIR] if extra else [CONFIG_DIR]


def find(kernel: str, device_name: str, capability: str, folder: Path) -> dict[str, Any]:
    """The config of `kernel` in `folder` tuned on this device by name, else on one of the same compute capability."""
    exact = folder / file_name(kernel, device_name)
    if exact.exists():
        return json.loads(exact.read_text())
    for path in sorted(folder.glob(f"{kernel}-*.json")):
        config = json.loads(path.read_text())
        if config.get("compute_capability") == capability:
            return config
    return {}
