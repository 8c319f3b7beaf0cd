"""Images in the batch: pagedmlx's engine against mlx-vlm's own batched generation, same model, same run.

A random-weight Gemma 3 vision-language model (mlx-vlm's class; --shape 4b: Gemma 3 4B's widths, a SigLIP tower
of 896-pixel images in 256 image tokens; --shape tiny for a CPU) gets --batch requests, each one image and a short
question, and generates --gen-len tokens each (greedy; pagedmlx ignores EOS, mlx-vlm's count is what it
generated). Reported per engine: output tok/s over the whole wall time (vision towers and prefill included), the
median of --repeats runs, and the ratio. --text-only N also runs N text-only requests through this engine and
through a text-only engine over the same language model: what serving images costs text requests.

  python scripts/bench/bench_vision.py --shape 4b --dtype bfloat16 --batch 32 --gen-len 128
  python scripts/bench/bench_vision.py --shape tiny --batch 4 --gen-len 16        # a CPU
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx import LLM, SamplingParams  # noqa: E402
from pagedmlx.loaders.random_model import tiny_tokenizer  # noqa: E402
from pagedmlx.multimodal.loader import build_vlm, split_vlm  # noqa: E402

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + BOI + "{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# (text widths, vision widths, image pixels, image tokens); vocabularies are 262,208 as Gemma 3's.
SHAPES = {
    "4b": (dict(hidden_size=2560, num_hidden_layers=34, intermediate_size=10240, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, sliding_window=1024, sliding_window_pattern=6,
                query_pre_attn_scalar=256),
           dict(hidden_size=1152, num_hidden_layers=27, intermediate_size=4304, num_attention_heads=16,
                patch_size=14), 896, 256, 262208),
    "tiny": (dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=64, sliding_window_pattern=2,
                  query_pre_attn_scalar=16),
             dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2, patch_size=4),
             16, 4, 1024),
}


def _one_image_per_prompt():
    """Gemma3Processor that reads a flat image list beside as many prompts as one image per prompt: mlx-vlm 0.7.10's
    batch_generate hands it the batch's images flat, which the processor takes as one prompt's images."""
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor

    class OneImagePerPrompt(Gemma3Processor):
        def __call__(self, text=None, images=None, **kwargs):
            if isinstance(text, list) and isinstance(images, list) and len(text) == len(images) > 1 \
                    and not isinstance(images[0], list):
                images = [[image] for image in images]
            return super().__call__(text=text, images=images, **kwargs)

    return OneImagePerPrompt


def gemma3_vlm(shape: str, dtype: mx.Dtype):
    """(mlx-vlm model, processor) of a random Gemma 3 VLM at `shape`'s widths."""
    from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
    from mlx_vlm.utils import StoppingCriteria
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    text, vision, pixels, tokens, vocab = SHAPES[shape]
    config = dict(model_type="gemma3", hidden_size=text["hidden_size"], image_token_index=vocab - 1, pad_token_id=0,
                  vocab_size=vocab,
                  text_config=dict(model_type="gemma3_text", vocab_size=vocab, mm_tokens_per_image=tokens,
                                   rms_norm_eps=1e-6, max_position_embeddings=131072, rope_global_base_freq=1e6,
                                   rope_local_base_freq=1e4, **text),
                  vision_config=dict(model_type="siglip_vision_model", image_size=pixels, layer_norm_eps=1e-6,
                                     **vision))
    model = build_vlm(config, seed=0, scale=1.0)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    hf = copy.deepcopy(tiny_tokenizer(vocab - 3)._tokenizer)
    hf.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE]})
    hf.boi_token, hf.eoi_token, hf.image_token = BOI, EOI, IMAGE
    hf.image_token_id = hf.convert_tokens_to_ids(IMAGE)
    hf.chat_template = TEMPLATE
    processor_class = _one_image_per_prompt()
    image_processor = Gemma3ImageProcessorPil(size={"height": pixels, "width": pixels}, do_pan_and_scan=False)
    processor = processor_class(image_processor, hf, image_seq_length=tokens, chat_template=TEMPLATE)
    processor.detokenizer = NaiveStreamingDetokenizer(hf)  # what mlx-vlm's load_processor adds
    hf.stopping_criteria = StoppingCriteria([hf.eos_token_id], hf)
    return model, processor


def images(n: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(640, 480), (480, 640), (800, 800), (1024, 768)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
            for w, h in (sizes[i % len(sizes)] for i in range(n))]


QUESTION = "What is in this picture? Describe it in detail."


def chat_prompt(model, processor) -> str:
    """The question with one image, through the chat template as mlx-vlm's batch_generate formats it."""
    from mlx_vlm.prompt_utils import apply_chat_template

    return apply_chat_template(processor, model.config, QUESTION, num_images=1)


def run_pagedmlx(llm: LLM, pics: list, gen_len: int, text_only: int = 0, prompt: str = "") -> float:
    """Output tok/s of `pics` requests with one image each (`prompt`: their text, one image marker), or of
    `text_only` text requests, over the wall time."""
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": p}} for p in pics]
    prompts += [f"Question {i}: {QUESTION} Answer in detail." for i in range(text_only)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def run_mlx_vlm(model, processor, pics: list, gen_len: int) -> float:
    from mlx_vlm import batch_generate

    t0 = time.perf_counter()
    out = batch_generate(model, processor, images=pics, prompts=[QUESTION] * len(pics), max_tokens=gen_len)
    wall = time.perf_counter() - t0
    return out.stats.generation_tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--text-only", type=int, default=0, help="text-only requests beside the image ones")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    args = ap.parse_args()
    model, processor = gemma3_vlm(args.shape, getattr(mx, args.dtype))
    config = {"kv_cache_memory_gb": args.kv_cache_gb} if args.kv_cache_gb else {}
    # Two engines in one process: the first takes half of the default memory fraction, the text-only one what is
    # left of the whole (the budget counts the first's pool as held).
    first = config or ({"gpu_memory_utilization": 0.45} if args.text_only else {})
    llm = LLM(model=model, tokenizer=processor, max_num_seqs=max(args.batch + args.text_only, 1), **first)
    pics = images(args.batch)
    prompt = chat_prompt(model, processor)
    run_pagedmlx(llm, pics[:2], 4, prompt=prompt)  # warm-up: kernels, the tower's first call
    text_llm = None
    if args.text_only:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        text_llm = LLM(model=split_vlm(model)[0], tokenizer=TokenizerWrapper(processor.tokenizer),
                       max_num_seqs=args.text_only, **config)
        run_pagedmlx(text_llm, [], 4, 2)
    ours, peer, text_vlm, text_plain = [], [], [], []
    for r in range(args.repeats):
        ours.append(run_pagedmlx(llm, pics, args.gen_len, prompt=prompt))
        if not args.skip_peer:
            peer.append(run_mlx_vlm(model, processor, pics, args.gen_len))
        if text_llm is not None:
            text_vlm.append(run_pagedmlx(llm, [], args.gen_len, args.text_only))
            text_plain.append(run_pagedmlx(text_llm, [], args.gen_len, args.text_only))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    device = mx.device_info().get("device_name", str(mx.default_device()))
    print(f"\n{device}, Gemma 3 {args.shape} shape, {args.dtype}, {args.batch} requests x 1 image, "
          f"{args.gen_len} new tokens (medians of {args.repeats})")
    print(f"{'engine':>22} {'out tok/s':>10}")
    print(f"{'pagedmlx':>22} {statistics.median(ours):>10.1f}")
    if peer:
        print(f"{'mlx-vlm batch_generate':>22} {statistics.median(peer):>10.1f}")
        print(f"pagedmlx / mlx-vlm: {statistics.median(ours) / statistics.median(peer):.2f}x")
    if text_vlm:  # the two engines take turns in each repeat: the per-repeat ratios show the run-to-run spread
        vlm, plain = statistics.median(text_vlm), statistics.median(text_plain)
        ratios = sorted(a / b for a, b in zip(text_vlm, text_plain))
        print(f"{args.text_only} text-only requests: {vlm:.1f} tok/s on this engine, {plain:.1f} on a text-only one "
              f"({vlm / plain:.2f}x; per repeat {', '.join(f'{r:.2f}x' for r in ratios)})")


if __name__ == "__main__":
    main()
