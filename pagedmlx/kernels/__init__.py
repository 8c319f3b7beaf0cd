"""Every custom kernel of pagedmlx: what it computes, for which layer kind, on which backend.

    module                  kernel, layer kind                              backend       source (sources/)
    decode_attention.py     paged decode attention: full, sliding window,   CUDA, Metal   decode_attention.py;
                            shared KV, attention sinks                                    tensor cores (CUDA):
                                                                                          decode_attention_mma_cuda.py
    prefill_attention.py    paged prefill attention: the same layers        CUDA          prefill_attention_cuda.py
    page_write.py           the page write: every layer that owns pages     CUDA (*)      page_write.py
    recurrent_state.py      gated delta rule, short convolution, state      CUDA          recurrent_state_cuda.py
                            write: recurrent-state layers
    lora.py                 batched LoRA (shrink + expand + add, each row   CUDA, Metal   lora.py
                            its own adapter): LoRA-targeted linear layers

    (*) built and checked for Metal too, not used there yet: MLX's scatter writes the pages.

dialect.py renders one source text for CUDA or Metal (sources without a backend suffix are in it);
build.py builds kernels (the process's GPU backend, MLX's custom-kernel call, device constants);
disk_cache.py keeps the CUDA ones compiled on disk (nvrtc.py compiles them as MLX does, in
compile_workers.py's processes on a first start); launch_configs.py reads launch shapes tuned per GPU;
selector.py decides at load which kernels a process runs (its KernelPlan), after check.py's
checks against the portable path. runner/ calls the kernels where the plan says so, and gathers
pages into MLX's attention (SDPA) everywhere else.
"""
