"""Per-rank memory of a random-weight llama served by one process or split over N ranks.

Prints, for each rank: weights held (bytes; transformer layers and the rest: embeddings, LM
head, final norm), the KV pool (bytes, blocks), and MLX's active and peak memory after a short
generation (8 requests x 32 tokens). The same --num-blocks on every run, so the KV bytes compare
page for page.

  python scripts/bench/tp_memory.py                # one process
  python scripts/bench/tp_memory.py --tp 2         # two ranks on this machine (ring on loopback)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.tp import engine as tp_engine  # noqa: E402
from pagedmlx.tp.group import join_group  # noqa: E402
from pagedmlx.config import EngineConfig  # noqa: E402
from pagedmlx.engine import LLMEngine  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
             num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=32000,
             tie_word_embeddings=False)


def random_llama():
    from mlx_lm.models import llama

    mx.random.seed(0)
    return llama.Model(llama.ModelArgs.from_dict(LLAMA))  # lazy: a rank materialises only its shard


def nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    config = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, max_model_len=1024)
    group = join_group(args.tp)
    model = random_llama()
    if group is not None and group.rank() > 0:
        tp_engine.run_worker(model, config, group)
    else:
        if group is None:
            engine = LLMEngine(model, None, config)
        else:
            engine = tp_engine.build_engine(model, None, config, group)
        for i in range(8):
            engine.add_request(str(i), [(7 * i + j) % 1000 + 1 for j in range(64)],
                               SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        if group is not None:
            engine.runner.close()
    runner_pool = (engine.runner.kv_pool if group is None or group.rank() == 0 else None)
    layers = nbytes(model.model.layers.parameters() if hasattr(model.model.layers, "parameters")
                    else [layer.parameters() for layer in model.model.layers])
    row = [group.rank() if group else 0, nbytes(model.parameters()), layers, mx.get_active_memory(),
           mx.get_peak_memory()]
    if group is None:
        rows = [row]
    else:
        rows = mx.distributed.all_gather(mx.array([row], mx.int64), group=group, stream=mx.cpu).tolist()
    if group is None or group.rank() == 0:
        kv = runner_pool.nbytes
        for rank, weights, layer_bytes, active, peak in rows:
            print(json.dumps(dict(ranks=group.size() if group else 1, rank=rank, weights=weights,
                                  weights_layers=layer_bytes, weights_other=weights - layer_bytes,
                                  kv_pool=kv, blocks=engine.runner.num_blocks, mlx_active=active, mlx_peak=peak)))
        if group is not None:
            engine.shutdown()


if __name__ == "__main__":
    main()
