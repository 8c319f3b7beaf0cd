"""A vLLM user's multimodal chat request (OpenAI SDK, a base64 image) to `pagedmlx serve`'s app over a tiny Gemma 3:
the same tokens as the offline LLM.chat of the same messages. Runs where the server takes image parts
(pagedmlx/server/chat_media.py, the mm-server branch)."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("pagedmlx.server.chat_media")

from mm_utils import gemma3_processor, gemma3_vlm, image  # noqa: E402
from server_utils import MODEL, Served  # noqa: E402

from pagedmlx import LLM, SamplingParams  # noqa: E402
from pagedmlx.engine.llm_engine import LLMEngine  # noqa: E402
from pagedmlx.config import EngineConfig  # noqa: E402
from pagedmlx.multimodal import split_vlm, vlm_processor  # noqa: E402
from pagedmlx.server.chat_media import MediaOptions  # noqa: E402
from pagedmlx.server.serving import ServerLimits  # noqa: E402


def test_an_openai_sdk_chat_with_a_base64_image_gives_the_offline_tokens():
    config = dict(block_size=4, num_blocks=128, max_num_batched_tokens=24)
    text, encoder = split_vlm(gemma3_vlm())
    processor, tokenizer = vlm_processor(gemma3_processor(), encoder)
    served = Served(LLMEngine(text, tokenizer, EngineConfig(**config), mm_encoder=encoder), mm_processor=processor,
                    media=MediaOptions(), limits=ServerLimits(max_body_bytes=1 << 20, max_n=4))
    try:
        contents = []
        for seed, size in ((3, (30, 20)), (4, (16, 40))):
            buf = io.BytesIO()
            image(seed, size).save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            contents.append([{"type": "text", "text": "Hello "}, {"type": "image_url", "image_url": {"url": url}},
                             {"type": "text", "text": " what is this?"}])
        client = served.client()
        got = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": c}], max_tokens=8,
                                              temperature=0).choices[0].message.content for c in contents]
    finally:
        served.stop()
    llm = LLM(gemma3_vlm(), tokenizer=gemma3_processor(), **config)
    params = SamplingParams(max_tokens=8, temperature=0)
    want = [llm.chat([{"role": "user", "content": c}], params)[0].outputs[0].text for c in contents]
    assert got == want and got[0] != got[1]
