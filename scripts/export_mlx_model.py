"""Write a model pagedmlx can load (a .gguf file, the default model, random:...) as an mlx-lm
model folder (config.json, model.safetensors, tokenizer files), so that mlx-lm's own tools
(mlx_lm.server, mlx_lm.generate) can run the very same weights for side-by-side benchmarks.

  python scripts/export_mlx_model.py default /tmp/smollm2-mlx
  mlx_lm.server --model /tmp/smollm2-mlx
  python scripts/export_mlx_model.py --tokenizer-only default /tmp/smollm2-tok   # just its tokenizer files
  python scripts/export_mlx_model.py preset:llama-8b /tmp/llama8b --dtype bfloat16 --tokenizer /tmp/smollm2-tok
  python scripts/export_mlx_model.py --vllm-config preset:llama-8b-4bit /tmp/llama8b-vllm   # for vLLM, no weights

`preset:NAME` is a random-weight model of pagedmlx.bench.presets (real widths; bench/presets.py's
preset_model, as `pagedmlx bench throughput preset:NAME` loads it): its vocabulary sized to the
--tokenizer given, so that served benchmarks detokenize real text, or without one the tiny tokenizer
padded to the preset's own vocabulary.

--vllm-config writes what vLLM's `--load-format dummy` needs to run the same shape with random weights of its own:
a Hugging Face config.json (a Llama preset; a 4-bit one as AWQ at the same group size, which vLLM runs through its
Marlin kernels) and the tiny tokenizer, no weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedmlx.bench.presets import PRESET_PREFIX, PRESETS, preset_model, split_preset_name  # noqa: E402
from pagedmlx.loaders.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="default, a .gguf file, random:ARCH, preset:NAME, an mlx-lm folder")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    ap.add_argument("--tokenizer", default=None,
                    help="preset: a folder with tokenizer files (default: the tiny one, padded to the preset's "
                         "vocabulary)")
    ap.add_argument("--tokenizer-only", action="store_true", help="write only the tokenizer files")
    ap.add_argument("--vllm-config", action="store_true", help="a preset's Hugging Face config and the tiny tokenizer "
                    "for vLLM's --load-format dummy (no weights)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.vllm_config:
        return write_vllm_config(args.model, out, args.dtype or "bfloat16")
    if args.model.startswith(PRESET_PREFIX):
        model, tokenizer = preset_model(args.model, args.dtype, args.tokenizer)
    else:
        model, tokenizer = load_model(None if args.model == "default" else args.model)
        if args.dtype:
            model.set_dtype(getattr(mx, args.dtype))
    tokenizer = tokenizer._tokenizer  # the Hugging Face tokenizer inside mlx-lm's wrapper
    tokenizer.save_pretrained(str(out))
    if args.tokenizer_only:
        print(f"wrote {out} (tokenizer, {len(tokenizer)} tokens)")
        return
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"wrote {out} ({config['model_type']}, "
          f"{sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e6:.0f} MB)")


def write_vllm_config(model: str, out: Path, dtype: str) -> None:
    from pagedmlx.loaders.random_model import tiny_tokenizer

    name, quantization = split_preset_name(model)
    cfg = PRESETS.get(name)
    if not model.startswith(PRESET_PREFIX) or cfg is None or cfg["model_type"] != "llama":
        raise SystemExit(f"--vllm-config takes a Llama preset (preset:llama-8b[-4bit]), not {model!r}")
    if quantization is not None and (quantization.bits != 4 or quantization.head_bits not in (None, 4)):
        raise SystemExit(f"--vllm-config: vLLM runs 4-bit as AWQ; {model!r} is {quantization.suffix}")
    hf = dict(cfg, architectures=["LlamaForCausalLM"], hidden_act="silu", torch_dtype=dtype,
              max_position_embeddings=8192, bos_token_id=0, eos_token_id=1)
    if quantization is not None:  # AWQ's layers, quantized as mlx-lm's affine ones: 4 bits, zero points, the groups
        hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": quantization.group_size,
                                     "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    tiny_tokenizer()._tokenizer.save_pretrained(str(out))  # vLLM's random prompts: ids of this vocabulary
    print(f"wrote {out} (vLLM config of {model}, no weights)")


if __name__ == "__main__":
    main()
