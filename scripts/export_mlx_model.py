"""Write a model pagedmlx can load (a .gguf file, the default model, random:...) as an mlx-lm
model folder (config.json, model.safetensors, tokenizer files), so that mlx-lm's own tools
(mlx_lm.server, mlx_lm.generate) can run the very same weights for side-by-side benchmarks.

  python scripts/export_mlx_model.py default /tmp/smollm2-mlx
  mlx_lm.server --model /tmp/smollm2-mlx
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedmlx.loader import load_model  # noqa: E402


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    name, out = sys.argv[1], Path(sys.argv[2])
    model, tokenizer = load_model(None if name == "default" else name)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer._tokenizer.save_pretrained(str(out))
    print(f"wrote {out} ({config['model_type']}, {sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
