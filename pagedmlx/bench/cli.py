"""`pagedmlx bench serve | throughput | latency`: the parsers, under `vllm bench`'s flag names and defaults
(where they differ, the help says so). Nothing heavy is imported until a benchmark runs."""

from __future__ import annotations

import argparse

from pagedmlx.engine.arg_utils import non_negative, server_port


def add_dataset_args(p: argparse.ArgumentParser, offline: bool = False) -> None:
    """The dataset options of both commands (datasets.py); `offline` adds vLLM throughput's
    --input-len / --output-len spellings of the random lengths."""
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random",
                   help="random token prompts, or a ShareGPT-style JSON file (--dataset-path) (default random)")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT-style JSON file")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default 1000)")
    inp = ["--random-input-len", "--input-len"] if offline else ["--random-input-len"]
    out = ["--random-output-len", "--output-len"] if offline else ["--random-output-len"]
    p.add_argument(*inp, dest="random_input_len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument(*out, dest="random_output_len", type=int, default=128,
                   help="output tokens (max_tokens) (default 128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default 0)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own (default 0)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max_tokens of every ShareGPT request (default: the length of the conversation's reply)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_dataset_args(p)
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions (default openai)")
    p.add_argument("--endpoint", default=None, help="the API path (default: the backend's)")
    p.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (default: --host, --port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=server_port, default=8000)
    p.add_argument("--api-key", default=None, help="the server's key (default: $OPENAI_API_KEY, $PAGEDMLX_API_KEY)")
    p.add_argument("--model", default=None, help="model id sent in requests (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer (folder, hub name, or random:ARCH) whose vocabulary less its special tokens "
                        "random prompts are drawn from (default: token ids 3-258, which every vocabulary holds)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send random prompts to /v1/completions as text (the --tokenizer's decoding, as long in its "
                        "tokens; without one, plain words) rather than token ids: for servers that take only text "
                        "(mlx_lm.server). The chat endpoint always gets text")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, arriving as a Poisson process (gamma with --burstiness); inf sends "
                        "them all at once (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival intervals: 1 Poisson, < 1 burstier, > 1 more even (default 1)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM's ignore_eos)")
    p.add_argument("--temperature", type=non_negative(float), default=0.0, help="(default 0.0: greedy, as vLLM)")
    p.add_argument("--extra-body", default=None, help='JSON merged into every request body, e.g. \'{"top_k": 20}\'')
    p.add_argument("--num-warmups", type=int, default=0, help="warm-up requests before the run (default 0)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles of, from ttft,tpot,itl,e2el (default all four; vLLM: "
                        "ttft,tpot,itl)")
    p.add_argument("--metric-percentiles", default="50,90,99",
                   help="percentiles to report (default 50,90,99; vLLM: 99)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (ms): requests meeting all of them per s")
    p.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's fields)")
    p.add_argument("--result-dir", default=None, help="directory of the result JSON (default: here)")
    p.add_argument("--result-filename", default=None,
                   help="file name of the result JSON "
                        "(default: {backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json)")
    p.add_argument("--num-processes", type=int, default=1,
                   help="client processes to split the prompts, concurrency and rate over, when one process would "
                        "be the bottleneck (the report says when) (default 1)")


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    from pagedmlx.engine.arg_utils import add_engine_args

    add_engine_args(p)
    add_dataset_args(p, offline=True)
    p.add_argument("--temperature", type=non_negative(float), default=1.0, help="(default 1.0, top_p 1.0: vLLM's)")
    p.add_argument("--output-json", default=None, help="write the result JSON (vLLM's fields) to this file")


def add_latency_args(p: argparse.ArgumentParser) -> None:
    from pagedmlx.engine.arg_utils import add_engine_args

    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=128, help="tokens each request generates (default 128)")
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default 8)")
    p.add_argument("--n", type=int, default=1, help="sequences generated per prompt (default 1)")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first (default 10)")
    p.add_argument("--num-iters", type=int, default=30, help="timed iterations (default 30)")
    p.add_argument("--temperature", type=non_negative(float), default=1.0,
                   help="(default 1.0, top_p 1.0: vLLM's; 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="token ids only: detokenizing left out of the latency (SamplingParams.detokenize=False)")
    p.add_argument("--output-json", default=None, help="write the result JSON (vLLM's fields) to this file")
    p.set_defaults(enable_prefix_caching=False)  # vLLM's: the same prompts run every iteration


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks, as vllm bench: serve (a running server), throughput and latency "
                                     "(offline)")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="{serve,throughput,latency}")
    add_serve_args(bench.add_parser(
        "serve", help="benchmark a running OpenAI-compatible server (pagedmlx serve, mlx_lm.server, vLLM)",
        description="Benchmark a running OpenAI-compatible server, as `vllm bench serve`."))
    add_throughput_args(bench.add_parser(
        "throughput", help="benchmark the offline engine (LLM.generate)",
        description="Benchmark the offline engine (LLM.generate), as `vllm bench throughput`."))
    add_latency_args(bench.add_parser(
        "latency", help="the time one batch of requests takes to finish (LLM.generate)",
        description="The time one batch of requests takes to finish on the offline engine, as `vllm bench latency` "
                    "(prefix caching off unless --enable-prefix-caching)."))


def run_bench(args: argparse.Namespace) -> int:
    import sys

    if args.bench_command in ("throughput", "latency"):
        if args.bench_command == "throughput":
            from pagedmlx.bench.throughput import bench_throughput as bench
        else:
            from pagedmlx.bench.latency import bench_latency as bench
        try:
            return 0 if bench(args) is not None else 1  # None: the engine could not start (said)
        except ValueError as exc:
            print(f"pagedmlx bench {args.bench_command}: {exc}", file=sys.stderr)
            return 2
    from pagedmlx.bench.serve import BenchError, bench_serve

    try:
        result = bench_serve(args)
    except BenchError as exc:
        print(f"pagedmlx bench serve: {exc}", file=sys.stderr)
        return 1
    return 0 if result["completed"] else 1
