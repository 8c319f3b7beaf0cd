"""The child of engine/kernel_prebuild.py: the engine on a shallow copy of a model, warmed up, so that a first start's
kernels are compiled into the disk caches while the parent reads the whole model's weights.

    python -m pagedmlx.engine.prebuild_child ARGS_PICKLE MARKER
"""

from __future__ import annotations

import json
import logging
import pickle
import sys
import time
from pathlib import Path
from typing import Sequence

from pagedmlx.engine.core import EngineCore
from pagedmlx.loaders.tokenizer_cache import load_tokenizer
from pagedmlx.platform import import_mlx_lm


def main(argv: Sequence[str]) -> int:
    """The child: the engine on a shallow copy of the model, warmed up; MARKER written when all of it ran."""
    args, marker = Path(argv[0]), Path(argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import_mlx_lm()
    import mlx_lm.utils

    config, overrides = pickle.loads(args.read_bytes())
    folder = Path(config.model)
    model, model_config = mlx_lm.utils.load_model(folder, lazy=True, strict=False, model_config=overrides)
    tokenizer = load_tokenizer(folder, model_config.get("eos_token_id", None))
    engine = EngineCore(model, tokenizer, config)  # no identity: its checks are not kept
    engine.warm_up()
    marker.write_text(json.dumps({"layers": overrides, "when": time.time()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
