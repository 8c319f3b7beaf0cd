"""The child of engine/kernel_prebuild.py: the engine on a shallow copy of a model, warmed up, so that a first start's
kernels are compiled into the disk caches while the parent reads the whole model's weights.

    python -m pagedmlx.engine.prebuild_child ARGS_PICKLE MARKER
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from pagedmlx.engine.core import EngineCore
from pagedmlx.loaders.tokenizer_cache import load_tokenizer
from pagedmlx.platform import import_mlx_lm
from pagedmlx.sampling_params import SamplingParams


def main(argv: Sequence[str]) -> int:
    """The child: the engine on a shallow copy of the model, warmed up; MARKER written when all of it ran."""
    args, marker = Path(argv[0]), Path(argv[1])
    _exit_with_parent(os.getppid())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import_mlx_lm()
    import mlx_lm.utils

    config, overrides = pickle.loads(args.read_bytes())
    folder = Path(config.model)
    model, model_config = mlx_lm.utils.load_model(folder, lazy=True, strict=False, model_config=overrides)
    tokenizer = load_tokenizer(folder, model_config.get("eos_token_id", None))
    engine = EngineCore(model, tokenizer, config)  # no identity: its checks are not kept
    engine.warm_up()
    tokens = serve_first_requests(engine)
    marker.write_text(json.dumps({"layers": overrides, "tokens": tokens, "when": time.time()}))
    return 0


def _exit_with_parent(parent: int) -> None:
    """A child whose engine is gone (killed in its start) stops at once: its builds are no one's, its memory is."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="pagedmlx-prebuild-parent", daemon=True).start()


def serve_first_requests(engine: EngineCore) -> int:
    """Two short requests, greedy and sampled (temperature, top-p, top-k, logprobs), run to the end: the first
    request a server answers then meets no build of its own (the sampler's, a decode step's). Returns the tokens
    they got."""
    prompt = [i % engine.vocab_size for i in range(1, 17)]
    engine.add_request("prebuild-greedy", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("prebuild-sampled", prompt[::-1], SamplingParams(temperature=0.7, top_p=0.9, top_k=20,
                                                                        max_tokens=4, ignore_eos=True, logprobs=2))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
