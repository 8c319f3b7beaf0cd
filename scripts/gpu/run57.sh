#!/usr/bin/env bash
# Run 57 (2026-12-05, twentieth session), one call after staging (../shared/gpu/README.md), in order of what it
# closes: int8 pages' decode at 64 and 256 after the scale and bias moved after the products (issue 29's last
# speed target), and again with PAGEDMLX_QUANT_AFTER=0 (the dequantized tiles: what the change buys; both runs
# also have the tensor-core products' zero rows dropped, which frees int4's kernel 5 registers); the GPU check of that kernel (int8 cases of the decode kernel test); why run 56's int8 engine
# took 3.2x bf16 pages' wall time end to end at 64 x 512 (decode alone 0.97x): the prefill steps one by one,
# int8 then bf16 pages, each in a fresh process, and bench_offline again with full-length warm-up prompts.
# PART=phases (twenty-first session): int8 / int4 decode with PAGEDMLX_QUANT_PREFETCH=0 (no next tile staged in
# registers: int8's scale-after kernel 164 registers instead of 198, three 128-thread groups an SM instead of two;
# issue 29); then where a speculative round's host time goes on the H200, phase by phase (bench_draft.py --phases,
# spec_phases.py), on the Llama-8B-shaped pair with an exact 4-layer draft (issue 28).
source "$(dirname "$0")/lib.sh"
SUITE=(env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider)
OFF="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 512 --gen-len 64 --batch-sizes 64 --skip-peer --repeats 2"
PROF="python3 scripts/bench/profile_prefill_steps.py --prompts 64 --length 512"
# PART=core / PART=rest (twenty-second session, device time short): the same runs in two calls, what decides most
# first: the round's phases (issue 28), batch 1 with and without the fused residual norms (new), int8 decode with
# and without the prefetch (issue 29), the int8 kernel's GPU test.
if [ -z "${CONTEXT:-}" ] && [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)" -lt 100000 ] 2>/dev/null; then
  CONTEXT=1024  # an H100: 256 x 2048 tokens of bf16 pages (64 GiB) and the weights would not fit
fi
echo "== $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1), KV context ${CONTEXT:-2048}"
KV="python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --context ${CONTEXT:-2048} --batch 64 256 --steps 12"  # CONTEXT=1024 on an H100 (80 GB at 256 x 2048)
DRAFT="python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 --k 4 --target-tail-scale 0 --rounds 1 --prompts 2 --max-tokens 96 --kv-cache-gb 4 --phases"
# decodes of a few requests (the skinny GEMM's runs, twenty-third and twenty-fourth sessions); SMALL248: 2, 4 and 8
SMALL="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 128 --gen-len 64 --skip-peer --repeats 1"
SMALL248="$SMALL --batch-sizes 2 4 8"
case "${PART:-all}" in
  core)  # in order of what decides most; the limits add up to under a call's 600 s
    TAIL=40 run draft_phases 150 $DRAFT
    TAIL=10 run batch1_fused 100 python3 scripts/bench/bench_batch1.py preset:llama-8b --dtype bfloat16 --rounds 3
    TAIL=14 run kv_64_256 120 $KV
    TAIL=14 run kv_64_256_noprefetch 120 env PAGEDMLX_QUANT_PREFETCH=0 $KV
    TAIL=4 run pytest_kv_int8 90 "${SUITE[@]}" tests/test_gpu_kv_quant.py -k "decode_kernel and default and int8";;
  mini)  # what a nearly spent device budget still buys: the round's phases, batch 1 fused or not, int8 decode
    TAIL=40 run draft_phases 150 $DRAFT
    TAIL=10 run batch1_fused 100 python3 scripts/bench/bench_batch1.py preset:llama-8b --dtype bfloat16 --rounds 3
    TAIL=14 run kv_64_256 120 $KV;;
  tiny)  # the last minutes of a device budget: the round's phases and batch 1 fused or not
    TAIL=40 run draft_phases 150 $DRAFT
    TAIL=10 run batch1_fused 100 python3 scripts/bench/bench_batch1.py preset:llama-8b --dtype bfloat16 --rounds 3;;
  rest)
    TAIL=6 run offline_int8 120 $OFF --kv-cache-dtype int8
    TAIL=30 run prefill_steps_int8 90 $PROF --kv-cache-dtype int8
    TAIL=30 run prefill_steps_auto 90 $PROF
    TAIL=14 run kv_64_256_dequantized 150 env PAGEDMLX_QUANT_AFTER=0 $KV;;
  all)
    TAIL=14 run kv_64_256 150 python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --context 2048 \
      --batch 64 256 --steps 12
    TAIL=14 run kv_64_256_dequantized 150 env PAGEDMLX_QUANT_AFTER=0 python3 scripts/bench/bench_kv_quant.py --speed \
      --preset llama-8b --context 2048 --batch 64 256 --steps 12
    TAIL=4 run pytest_kv_int8 150 "${SUITE[@]}" tests/test_gpu_kv_quant.py -k "decode_kernel and default and int8"
    TAIL=30 run prefill_steps_int8 90 $PROF --kv-cache-dtype int8
    TAIL=30 run prefill_steps_auto 90 $PROF
    TAIL=6 run offline_int8 120 $OFF --kv-cache-dtype int8;;
  ab)  # twenty-third session: the int8 kernel's variants interleaved in one process (run 58's calls: dequantized
        # tiles won at 64, scale-after at 256, both at 1,024 tokens; 64 at 2,048 is runs 55-56's H200 point);
        # a speculative round's phases with the device drained before each dispatch (encoding, or a full queue?);
        # with K8=1, the draft pair at k 8 (does our lead grow with k?)
    VAR="python3 scripts/bench/bench_kv_quant.py --speed --variants int8 int8-dequant int8-noprefetch --preset llama-8b \
      --steps 10 --repeats 3"
    TAIL=8 run kv_variants_2048 120 $VAR --context 2048 --batch 64  # run 55/56's context (H200: 1.12-1.24x at 64)
    TAIL=8 run kv_variants_256 130 $VAR --context ${CONTEXT:-2048} --batch 256
    TAIL=40 run draft_drained 150 $DRAFT --phases-drained
    [ "${K8:-0}" = 1 ] && TAIL=12 run draft_k8 110 python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 \
      --draft layers:4 --k 8 --target-tail-scale 0 --rounds 1 --prompts 2 --max-tokens 96 --kv-cache-gb 4;;
  dispatch)  # twenty-third session: MLX's host cost per primitive by kind (gemv, cuBLASLt gemm of 2-64 rows, a custom
             # kernel), the device drained: does a verifying step's 9.5 ms of dispatch come from its 1 + k-row matmuls?
    TAIL=16 run dispatch 120 python3 scripts/bench/study_dispatch.py;;
  skinny)  # twenty-third session: the skinny GEMM (EngineConfig.skinny_gemm, built untimed) where it should pay: the
           # host cost per primitive beside cuBLASLt's, the speculative round, decodes of 2-8 requests
    TAIL=16 run dispatch 120 python3 scripts/bench/study_dispatch.py
    TAIL=40 run draft_skinny 170 $DRAFT --skinny-gemm
    TAIL=8 run offline_small 100 $SMALL248
    TAIL=8 run offline_small_skinny 100 $SMALL248 --skinny-gemm;;
  mma)  # twenty-fourth session: the tensor-core skinny GEMM (sources/skinny_gemm_mma_cuda.py) against cuBLASLt and
        # the lanes' kernel at Llama-8B's widths, each launch variant; then the engine with it: decodes of 2-8
        # requests with and without, and the speculative round
    TAIL=40 run study_skinny 150 python3 scripts/bench/study_skinny.py
    TAIL=16 run offline_small 100 $SMALL248
    TAIL=16 run offline_small_mma 100 $SMALL248 --skinny-gemm
    TAIL=40 run draft_mma 170 $DRAFT --skinny-gemm;;
  final)  # twenty-fourth session (run 61): the skinny GEMM (lanes' kernel, 2-5 rows) on against off, in one call: the
          # speculative pair (issue 28's ratio), then decodes of 2-8 requests (8 ran 0.77x with it on: why?)
    TAIL=40 run draft_skinny 200 $DRAFT --skinny-gemm
    TAIL=12 run draft_off 150 $DRAFT
    TAIL=16 run offline_small_skinny 100 $SMALL248 --skinny-gemm
    TAIL=16 run offline_small_off 100 $SMALL248
    TAIL=16 run offline_8_skinny 100 $SMALL --batch-sizes 8 --skinny-gemm;;
  graphs)  # why 8 requests' decode ran 0.77x with --skinny-gemm though it takes no skinny product (run 61): MLX's CUDA
           # graph cache keys graphs by node kinds and edges, not shapes, and custom kernels are other kinds than
           # cuBLASLt's captured child graphs; first in isolation (study_graph_cache.py, graphs on and off), then
           # the engine: 2 / 4 / 8 in one process with the kernel on and off, 8 alone, and both without graphs
    TAIL=10 run graph_cache 60 python3 scripts/bench/study_graph_cache.py
    TAIL=10 run graph_cache_nographs 60 env MLX_USE_CUDA_GRAPHS=0 python3 scripts/bench/study_graph_cache.py
    TAIL=8 run b248_skinny 90 $SMALL248 --skinny-gemm
    TAIL=8 run b248_off 90 $SMALL248
    TAIL=8 run b8_skinny 70 $SMALL --batch-sizes 8 --skinny-gemm
    TAIL=8 run b248_skinny_nographs 110 env MLX_USE_CUDA_GRAPHS=0 $SMALL248 --skinny-gemm
    TAIL=8 run b248_off_nographs 110 env MLX_USE_CUDA_GRAPHS=0 $SMALL248;;
  graphs2)  # run 62 left it open: 8 alone and graphs off lost nothing, and 2 / 4 / 8 with the kernel hit its limit.
            # Again with more time, 8 before and after 2 / 4 in one process, and with a graph cache of 4,000 entries
            # (does the 8-row step's working set fall out of the LRU of 400 once the few-row steps' graphs are in?)
    TAIL=8 run b248_skinny 130 $SMALL248 --skinny-gemm
    TAIL=8 run b8248_skinny 150 $SMALL --batch-sizes 8 2 4 8 --skinny-gemm
    TAIL=8 run b248_skinny_cache4000 130 env MLX_CUDA_GRAPH_CACHE_SIZE=4000 $SMALL248 --skinny-gemm
    TAIL=8 run b248_off 90 $SMALL248;;
  split)  # twenty-fifth session: the lanes' kernel with K split across a thread group's SIMD groups (narrow products
          # had 15 SIMD groups an SM): device time against cuBLASLt and unsplit, then the pair, 7 rounds, defaults
    TAIL=24 run study_split 120 python3 scripts/bench/study_skinny.py --rows 2 4 5
    TAIL=9 run draft_split_r7 210 ${DRAFT/--rounds 1 --prompts 2/--rounds 7 --prompts 4};;
  pair)  # next: run 65's pair stopped after 2 of 7 rounds (1.31x, 1.43x); the same with the time it needs, K split
         # from 4 rows (the default since run 65), then without the kernel beside it
    PAIR="${DRAFT/--rounds 1 --prompts 2/--rounds 7 --prompts 4}"
    PAIR="${PAIR% --phases}"  # the phases' extra pass is not part of the ratio and costs a minute
    TAIL=9 run draft_r7 320 $PAIR
    TAIL=9 run draft_r7_off 240 $PAIR --no-skinny-gemm;;
  startup)  # twenty-sixth session: the skinny GEMM's load-time check drew its inputs with numpy (Llama-8B: ~27 s on
            # the 2-core CPU); now on the device. The check timed alone, then start-up with the kernel and without
    TAIL=8 run skinny_check 150 python3 scripts/bench/study_skinny_check.py
    TAIL=6 run startup_on 150 $SMALL --batch-sizes 2
    TAIL=6 run startup_off 130 $SMALL --batch-sizes 2 --no-skinny-gemm;;
  profile_startup)  # run 67: start-up 59-82 s with the kernel against 13 s without, its check alone 0.03 s warm:
                    # where the rest goes (cProfile of LLMEngine's construction, start-up lines timestamped)
    TAIL=60 run startup_profile_on 200 python3 scripts/bench/profile_startup.py --top 45
    TAIL=30 run startup_profile_off 120 python3 scripts/bench/profile_startup.py --no-skinny-gemm --top 20;;
  ptxcache)  # run 68: custom kernels rebuilt in every process (the skinny check ~30 s)? Two processes of the check with
             # MLX's PTX cache directory set, and what the directories hold
    ls /tmp/mlx/*/ptx 2>/dev/null | sed 's/_[0-9a-f]*\.\(ptx\|txt\|cu\)$//' | sort | uniq -c | head -20
    export MLX_PTX_CACHE_DIR=/tmp/ptx-pagedmlx && mkdir -p $MLX_PTX_CACHE_DIR
    TAIL=8 run skinny_check_1 120 python3 scripts/bench/study_skinny_check.py
    TAIL=8 run skinny_check_2 120 python3 scripts/bench/study_skinny_check.py
    ls -la $MLX_PTX_CACHE_DIR | head -40;;
  ab8)  # run 63 put the spread between processes of one command (8 requests: 695-944 tok/s with the kernel, which
        # 8-row steps do not take) above the effect sought: processes with and without the kernel taking turns
    TAIL=16 run ab_skinny 560 python3 scripts/bench/ab_processes.py --runs 3 --timeout 170 --b=--skinny-gemm -- $SMALL248;;
  phases)  # a call of its own (PART=phases): the above takes about 8 of a call's 10 minutes
    TAIL=14 run kv_64_256_noprefetch 150 env PAGEDMLX_QUANT_PREFETCH=0 python3 scripts/bench/bench_kv_quant.py \
      --speed --preset llama-8b --context 2048 --batch 64 256 --steps 12
    TAIL=40 run draft_phases 200 python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 \
      --k 4 --target-tail-scale 0 --rounds 1 --prompts 2 --max-tokens 96 --kv-cache-gb 4 --phases;;
esac
