"""`pagedmlx bench serve | throughput | latency`, modeled on `vllm bench serve | throughput | latency`: the same flags,
metrics and result fields, so that served (any OpenAI-compatible server) and offline (`LLM.generate`)
figures come from one tool and one dataset code.

    datasets.py    the random and ShareGPT prompts, shared by both commands
    arrivals.py    request arrival times: Poisson, or gamma with --burstiness (vLLM's)
    sse.py         server-sent events: the byte stream to `data:` payloads, and what a payload says
    client.py      one streamed request over httpx, timed: a RequestRecord
    metrics.py     TTFT / TPOT / ITL / E2EL, throughput, goodput; vLLM's result block and JSON fields
    load.py        the load: arrival times, --max-concurrency, client CPU time; --num-processes clients
    serve.py       `bench serve`: test request, warm-ups, the run, vLLM's block and JSON, the CPU check
    throughput.py  `bench throughput`: LLM.generate on the same prompts
    latency.py     `bench latency`: one batch run to the end, timed over iterations
    presets.py     random weights at real models' widths, one per family: the `preset:NAME` models
    cli.py         the argparse parsers
"""
