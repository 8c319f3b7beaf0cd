"""Images across the engine-core process boundary: a prompt's features travel in the "add" message as bytes, and
the core process (which loads the mlx-vlm folder itself) gives the in-process engine's tokens."""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
from mlx.utils import tree_flatten

from mm_utils import FAMILIES, GEMMA3_VLM, gemma3_processor, gemma3_vlm, image
from utils import run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.async_engine import AsyncEngine
from pagedmlx.engine.core_client import CoreProcess
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.multimodal import split_vlm, vlm_processor
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONFIG = dict(block_size=4, num_blocks=96, max_num_batched_tokens=24)


def test_features_reach_a_core_process(tmp_path):
    vlm = gemma3_vlm()
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(vlm.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_VLM))
    hf_processor = gemma3_processor()
    hf_processor.tokenizer.save_pretrained(str(tmp_path))
    text, encoder = split_vlm(vlm)
    processor, tokenizer = vlm_processor(hf_processor, encoder)
    marker = FAMILIES["gemma3"].marker
    prompts = [processor.process(f"Hello {marker} world, what is", [image(5)]),
               processor.process(f"{marker} and {marker}", [image(6, (40, 20)), image(5)]),
               processor.process("The quick brown fox")]
    engine = LLMEngine(text, tokenizer, EngineConfig(**CONFIG), mm_encoder=encoder)
    for i, (ids, features) in enumerate(prompts):
        engine.add_request(str(i), ids, GREEDY, mm_features=features)
    want = {rid: list(out.token_ids) for rid, out in run_to_completion(engine).items()}

    ae = AsyncEngine(CoreProcess(EngineConfig(model=str(tmp_path), **CONFIG)))
    try:
        assert ae.info.takes_images and not ae.info.images_refused

        async def one(i: int, ids: list[int], features: list) -> list[int]:
            outs = [o async for o in ae.generate({"prompt_token_ids": ids, "mm_features": features}, GREEDY, str(i))]
            return list(outs[-1].outputs[0].token_ids)

        async def main():
            return await asyncio.gather(*(one(i, ids, f) for i, (ids, f) in enumerate(prompts)))

        got = asyncio.run(main())
    finally:
        ae.shutdown(timeout=0)
    assert got == [want[str(i)] for i in range(len(prompts))]
