"""Write a model pagedmlx can load (a .gguf file, the default model, random:...) as an mlx-lm
model folder (config.json, model.safetensors, tokenizer files), so that mlx-lm's own tools
(mlx_lm.server, mlx_lm.generate) can run the very same weights for side-by-side benchmarks.

  python scripts/export_mlx_model.py default /tmp/smollm2-mlx
  mlx_lm.server --model /tmp/smollm2-mlx
  python scripts/export_mlx_model.py --tokenizer-only default /tmp/smollm2-tok   # just its tokenizer files
  python scripts/export_mlx_model.py preset:llama-8b /tmp/llama8b --dtype bfloat16 --tokenizer /tmp/smollm2-tok

`preset:NAME` is a random-weight model of pagedmlx.bench.presets (real widths; bench/presets.py's
preset_model, as `pagedmlx bench throughput preset:NAME` loads it): its vocabulary sized to the
--tokenizer given, so that served benchmarks detokenize real text, or without one the tiny tokenizer
padded to the preset's own vocabulary.
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

from pagedmlx.bench.presets import PRESET_PREFIX, preset_model  # noqa: E402
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
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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


if __name__ == "__main__":
    main()
