"""vLLM's public API where a vLLM user reaches for it: the offline quickstart, prompt forms, n > 1,
the async generator, the CLI's vLLM/mlx-lm-shaped flags and the model's sampling defaults."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from utils import LOGPROB_ROUNDING, assert_solo_greedy, make_model, make_tokenizer


def test_vllm_offline_quickstart_verbatim():
    """vLLM's quickstart with pagedmlx's names (and a random-weight model instead of opt-125m)."""
    from pagedmlx import LLM, SamplingParams

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model="random:llama-tiny")
    outputs = llm.generate(prompts, sampling_params)
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        generated_text = output.outputs[0].text
        assert output.finished and len(output.outputs) == 1 and output.outputs[0].index == 0
        assert output.prompt_token_ids == list(tokenizer.encode(output.prompt))
        ids, reason = output.outputs[0].token_ids, output.outputs[0].finish_reason
        assert (reason, len(ids)) == ("length", 16) or (reason == "stop" and ids[-1] in tokenizer.eos_token_ids)
        special = set(tokenizer.all_special_ids)
        assert generated_text == tokenizer.decode([t for t in ids if t not in special])
        assert output.outputs[0].cumulative_logprob is None


def test_prompt_forms_give_mlx_lm_tokens():
    """Strings, token-id lists and vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts, mixed."""
    from pagedmlx import LLM, SamplingParams

    model, tok = make_model("llama"), make_tokenizer(512)
    llm = LLM(model, tok, block_size=4, num_blocks=128)
    ids = [5, 17, 300, 42, 9]
    text = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([ids, {"prompt_token_ids": ids}, text, {"prompt": text}], params)
    text_ids = list(tok.encode(text))
    assert [o.prompt for o in outs] == [None, None, text, text]
    assert [o.prompt_token_ids for o in outs] == [ids, ids, text_ids, text_ids]
    for i, (o, p) in enumerate(zip(outs, (ids, ids, text_ids, text_ids))):
        assert_solo_greedy(o.outputs[0].token_ids, model, p, 6, i)
    assert len({o.request_id for o in outs}) == 4
    one = llm.generate({"prompt_token_ids": ids}, params)  # a single prompt, not in a list
    assert len(one) == 1
    assert_solo_greedy(one[0].outputs[0].token_ids, model, ids, 6)
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        llm.generate({"prompt": text, "prompt_token_ids": ids}, params)
    with pytest.raises(ValueError, match="token ids"):  # the second prompt is refused: the first is not left behind
        llm.generate([ids, [10**9]], params)
    assert llm.engine.get_num_unfinished_requests() == 0
    assert_solo_greedy(llm.generate(ids, params)[0].outputs[0].token_ids, model, ids, 6)


def test_detokenize_false_gives_the_same_tokens_without_text():
    """vLLM's SamplingParams(detokenize=False): the same token ids and logprobs, no text and no decoded
    logprob tokens, in LLM.generate and AsyncEngine.generate; stop strings need the text, so they are refused."""
    from pagedmlx import LLM, AsyncEngine, SamplingParams

    model, tok = make_model("llama"), make_tokenizer(512)
    llm = LLM(model, tok, block_size=4, num_blocks=128)
    ids = [5, 17, 300, 42, 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    text, raw = llm.generate([ids, ids], [params, replace(params, detokenize=False)])
    for name, out in (("detokenized", text), ("raw", raw)):
        assert_solo_greedy(out.outputs[0].token_ids, model, ids, 6, name)
    assert text.outputs[0].text and raw.outputs[0].text == ""
    # The same prompt in two rows of one batch: the same token ids, their logprobs up to rounding.
    assert [list(d) for d in raw.outputs[0].logprobs] == [list(d) for d in text.outputs[0].logprobs]
    assert [lp.logprob for d in raw.outputs[0].logprobs for lp in d.values()] == \
        pytest.approx([lp.logprob for d in text.outputs[0].logprobs for lp in d.values()], abs=LOGPROB_ROUNDING)
    assert all(lp.decoded_token is None for d in raw.outputs[0].logprobs for lp in d.values())
    assert all(lp.decoded_token is not None for d in text.outputs[0].logprobs for lp in d.values())
    engine = AsyncEngine(llm.engine)

    async def run():
        return [o async for o in engine.generate(ids, replace(params, detokenize=False), "a")][-1]

    try:
        final = asyncio.run(run())
    finally:
        engine.shutdown()
    assert final.outputs[0].token_ids == raw.outputs[0].token_ids and final.outputs[0].text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_n_samples_are_grouped_in_order_with_their_seeds():
    """n > 1: one RequestOutput per prompt, outputs[i] is sample i, seeded with seed + i."""
    from pagedmlx import LLM, SamplingParams
    from pagedmlx.sampling_params import MAX_SEED

    llm = LLM(make_model("llama"), None, block_size=4, num_blocks=128)
    prompts = [[3, 4, 5, 6], [9, 8, 7]]
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))
    assert len(outs) == 2 and [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for i, c in enumerate(out.outputs):
            alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True))
            assert c.token_ids == alone[0].outputs[0].token_ids
    top = SamplingParams(n=2, temperature=1.0, seed=MAX_SEED, max_tokens=4, ignore_eos=True)
    wrapped = llm.generate([prompts[0]], top)[0].outputs  # seed + 1 wraps to 0, as a valid seed must
    assert wrapped[1].token_ids == llm.generate([prompts[0]], replace(top, n=1, seed=0))[0].outputs[0].token_ids


def test_async_generate_takes_vllms_argument_order():
    """AsyncEngine.generate(prompt, sampling_params, request_id), yielding cumulative RequestOutputs."""
    from pagedmlx import AsyncEngine, EngineConfig, LLMEngine, SamplingParams

    model = make_model("llama")
    engine = AsyncEngine(LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64)))
    params = SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)

    async def main():
        return [o async for o in engine.generate([1, 2, 3], params, "req-7")]

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1]) and final.request_id == "req-7"
    assert [c.index for c in final.outputs] == [0, 1]
    for c in final.outputs:
        assert_solo_greedy(c.token_ids, model, [1, 2, 3], 5, c.index)
    for c in final.outputs:  # logprobs gathered step by step: one dict per token, the sampled token first
        assert [next(iter(d)) for d in c.logprobs] == c.token_ids
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_package_import_is_lazy():
    """`import pagedmlx` must not import MLX: the CLI's --help and tools stay cheap."""
    code = "import sys, pagedmlx; assert 'mlx.core' not in sys.modules; print(sorted(pagedmlx.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "LLM" in out and "SamplingParams" in out and "RequestOutput" in out


def test_cli_takes_vllms_flags():
    from pagedmlx.cli import engine_config, make_parser

    args = make_parser().parse_args(["serve", "some/model", "-tp", "2", "--no-enable-prefix-caching",
                                     "--max-model-len", "4096", "--max-num-seqs", "8",
                                     "--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "128",
                                     "--async-scheduling", "--no-warm-up-attention", "--no-prefill-kernel",
                                     "--generation-config", "vllm"])
    config = engine_config(args)
    assert args.tp == 2 and config.model == "some/model"
    assert (config.enable_prefix_caching, config.max_model_len, config.max_num_seqs) == (False, 4096, 8)
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (512, 128)
    assert config.async_scheduling is True and config.generation_config == "vllm"
    assert config.warm_up_attention is False and config.prefill_kernel is False
    args = make_parser().parse_args(["serve", "--model", "m", "--tensor-parallel-size", "4"])
    assert args.tp == 4 and engine_config(args).model == "m" and engine_config(args).enable_prefix_caching
    assert engine_config(args).long_prefill_token_threshold == 512  # the CPU's default (CUDA's: 256)
    with pytest.raises(SystemExit):
        engine_config(make_parser().parse_args(["serve", "a", "--model", "b"]))


def test_generation_config_gives_defaults_and_requests_win(tmp_path):
    from pagedmlx.loaders.loader import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 256}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 256}
    assert generation_defaults(None) == {"temperature": 0.2, "top_p": 0.9}  # the default model's card
    assert generation_defaults("random:llama-tiny") == {}

    from pagedmlx import EngineConfig, LLMEngine

    engine = LLMEngine(make_model("llama"), None, EngineConfig(block_size=4, num_blocks=16))
    engine.generation_defaults = generation_defaults(str(tmp_path))
    params = engine.get_default_sampling_params(temperature=0.0)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 0.95, 20, 256)


@pytest.mark.slow
def test_generate_answers_the_default_models_question_without_chat_flag(smollm):
    """`pagedmlx generate --prompt "..."` applies the chat template itself, as mlx-lm's generate."""
    proc = subprocess.run([sys.executable, "-m", "pagedmlx.cli", "generate", "--prompt",
                           "What is the capital of France?", "--temperature", "0", "--max-tokens", "24"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout, proc.stdout
    raw = subprocess.run([sys.executable, "-m", "pagedmlx.cli", "generate", "random:llama-tiny", "--no-chat-template",
                          "--prompt", "What is the capital of France?", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300)
    assert raw.returncode == 0 and "chat template" not in raw.stderr and "chat template" in proc.stderr


@pytest.mark.parametrize("argv,message", [
    (["generate", "random:llama-tiny", "--prompt", "hi", "--speculative-config",
      '{"method": "draft_model", "model": "random:qwen3_5-tiny", "num_speculative_tokens": 2}'],
     "UnsupportedModelError: draft model type 'qwen3_5' has state layers"),
    (["bench", "latency", "random:no-such-arch"], "pagedmlx bench latency: the engine could not start:"),
    (["bench", "throughput", "random:no-such-arch"], "pagedmlx bench throughput: the engine could not start:"),
])
def test_in_process_commands_say_why_the_engine_could_not_start(capsys, argv, message):
    """generate and the offline benchmarks: a model (or draft model) that cannot be served is one line on
    stderr and exit status 1, as `serve` says it, not a traceback."""
    from pagedmlx.cli import main

    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the line
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"], ["bench", "latency"]])
def test_an_engine_value_the_config_refuses_exits_2_naming_it(capsys, command):
    """A flag value EngineConfig refuses (here --max-num-seqs 0) exits with status 2 and the reason on stderr,
    as argparse does for a bad flag, before any model loads: not a traceback."""
    from pagedmlx.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*command, "random:llama-tiny", "--max-num-seqs", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "max_num_seqs must be an integer >= 1, got 0" in err and "Traceback" not in err


def test_generate_refuses_a_prompt_longer_than_the_context_by_name(capsys):
    from pagedmlx.cli import main

    assert main(["generate", "random:llama-tiny", "--no-chat-template", "--max-model-len", "4",
                 "--prompt", "hello there how are you"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "pagedmlx generate: error: prompt has" in err and "(max_model_len)" in err


@pytest.mark.parametrize("argv,message", [
    (["serve", "--port", "99999"], "argument --port: must be a TCP port in [0, 65535], got 99999"),
    (["bench", "serve", "--port", "0"], "argument --port: must be a TCP port in [1, 65535], got 0"),
    (["bench", "latency", "m", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    (["serve", "--drain-timeout", "inf"], "argument --drain-timeout: must be a finite number, got inf"),
    (["blocks", "--watch", "--interval", "inf"], "argument --interval: must be a finite number, got inf"),
    (["blocks", "--watch", "--interval", "0"], "argument --interval: must be > 0, got 0"),
    (["serve", "--drain-timeout", "-5"], "argument --drain-timeout: must be >= 0, got -5"),
    (["serve", "--max-body-bytes", "0"], "argument --max-body-bytes: must be > 0, got 0"),
    (["serve", "--max-n", "0"], "argument --max-n: must be > 0, got 0"),
    (["serve", "--max-waiting", "-1"], "argument --max-waiting: must be > 0, got -1"),
    (["serve", "--tp", "0"], "must be > 0, got 0"),
    (["serve", "--served-model-name", " "], "argument --served-model-name: must not be empty"),
    (["serve", "--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
    (["serve", "--limit-mm-per-prompt", '{"video": 1}'], "argument --limit-mm-per-prompt: 'video': the modalities "
     "served are image"),
    (["serve", "--limit-mm-per-prompt", "image=4"], "argument --limit-mm-per-prompt: must be JSON"),
    (["serve", "--allowed-local-media-path", "/no/such/folder"], "argument --allowed-local-media-path: "
     "'/no/such/folder' is not a folder"),
])
def test_flags_out_of_range_are_refused_at_parse(capsys, argv, message):
    from pagedmlx.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_sharegpt_file_is_refused_before_the_model_loads(capsys, tmp_path):
    from pagedmlx.cli import main

    missing = str(tmp_path / "none.json")
    assert main(["bench", "throughput", "random:llama-tiny", "--dataset-name", "sharegpt", "--dataset-path",
                 missing]) == 2
    assert f"--dataset-path {missing}: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    from pagedmlx.bench.datasets import sharegpt_requests

    with pytest.raises(ValueError, match="cannot read a ShareGPT JSON file"):
        sharegpt_requests(str(bad), 2)
    bad.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="a JSON list of conversations, got dict"):
        sharegpt_requests(str(bad), 2)


def test_doctor_reports_a_model_that_does_not_load_and_exits_1(capsys):
    from pagedmlx.cli import main

    assert main(["doctor", "--model", "random:no-such-arch", "--no-timing"]) == 1
    out = " ".join(w for w in capsys.readouterr().out.split() if w != "│")  # the table's cells, wrapped
    assert "could not load" in out and "unknown random model 'no-such-arch'" in out
