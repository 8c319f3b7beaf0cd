"""scripts/export_mlx_model.py --vllm-config: the config vLLM's --load-format dummy runs for a preset's shape (the
yardstick of scripts/gpu/vllm_yardstick.sh), its widths the preset's, 4 bits as AWQ at the preset's group size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedmlx.bench.presets import PRESETS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "export_mlx_model.py"


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--vllm-config", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_llama_preset_is_written_with_its_widths_and_4_bits_as_awq(tmp_path):
    for name, quant in (("llama-8b", None), ("llama-8b-4bit-g128", 128)):
        out = tmp_path / name
        assert _export(f"preset:{name}", str(out)).returncode == 0
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert {k: config[k] for k in PRESETS["llama-8b"]} == PRESETS["llama-8b"]
        assert config.get("quantization_config", {}).get("group_size") == quant
        assert (out / "tokenizer.json").exists() and not (out / "model.safetensors").exists()


def test_what_vllm_would_not_run_the_same_is_refused_by_name(tmp_path):
    for name, why in (("preset:gemma4-e4b", "takes a Llama preset"), ("preset:llama-8b-8bit", "8bit")):
        done = _export(name, str(tmp_path / "x"))
        assert done.returncode != 0 and why in done.stderr
