"""The KV budget (runner/kv_budget.py): kv_cache_memory_gb when given; on a GPU backend what
gpu_memory_utilization of the device leaves after what is held and a profiled step; on the CPU the model's size."""

from __future__ import annotations

import pytest
from utils import make_model

from pagedmlx import LLM
from pagedmlx.config import EngineConfig
from pagedmlx.engine.core_info import kv_pool_line
from pagedmlx.runner import kv_budget
from pagedmlx.runner.lm_head import split_lm_head


def test_gpu_sizing_is_the_fraction_less_what_is_held_less_the_profiled_step(monkeypatch):
    model = make_model("llama")
    body, head = split_lm_head(model)
    peak = kv_budget.step_peak_bytes(body, head, 64, 64)
    assert peak is not None and peak > 64 * model.args.hidden_size * 4  # at least the hidden states it made
    config = EngineConfig(max_num_batched_tokens=64, gpu_memory_utilization=0.5)
    monkeypatch.setattr(kv_budget, "device_memory", lambda on_gpu: (8 * 10**9, "device memory"))
    monkeypatch.setattr(kv_budget, "held_bytes", lambda model: 10**9)  # weights and all else: 1 GB
    budget = kv_budget.kv_cache_budget(config, model, body, head, on_gpu=True)
    assert abs(budget.nbytes - (4 * 10**9 - 10**9 - peak)) < 2**20  # the peak measured again, to a MiB
    assert "gpu_memory_utilization 0.5 x 8.0 GB device memory - 1.00 GB held" in budget.how


def test_a_fraction_that_leaves_nothing_is_refused_by_name(monkeypatch):
    model = make_model("llama")
    monkeypatch.setattr(kv_budget, "device_memory", lambda on_gpu: (10**9, "device memory"))
    monkeypatch.setattr(kv_budget, "held_bytes", lambda model: 10**9)
    with pytest.raises(ValueError, match="no memory left for KV pages.*--gpu-memory-utilization"):
        kv_budget.kv_cache_budget(EngineConfig(gpu_memory_utilization=0.5), model, *split_lm_head(model), on_gpu=True)
    # Held far past the weights (another engine's pool in this process): the message says so
    monkeypatch.setattr(kv_budget, "held_bytes", lambda model: 3 * 10**9 + kv_budget.weights_nbytes(model))
    with pytest.raises(ValueError, match=r"held \(weights 0.\d\d GB, 3.00 GB other arrays \(another engine's pool"):
        kv_budget.kv_cache_budget(EngineConfig(gpu_memory_utilization=0.5), model, *split_lm_head(model), on_gpu=True)


@pytest.mark.parametrize("value", [0, -0.1, 1.01, "0.9"])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)


def test_the_cpu_pool_is_sized_to_the_model_and_the_start_up_line_says_how():
    llm = LLM(make_model("llama"), None)
    line = kv_pool_line(llm.engine.core)
    assert f"= {kv_budget.CPU_MIN_BYTES / 1e9:.2f} GB" in line and "sized by CPU: the model's" in line
    llm = LLM(make_model("llama"), None, kv_cache_memory_gb=0.01)
    assert kv_pool_line(llm.engine.core).endswith("sized by kv_cache_memory_gb 0.01")


def test_memory_other_processes_hold_lowers_the_pool_and_the_line_says_so(monkeypatch):
    model = make_model("llama")
    body, head = split_lm_head(model)
    config = EngineConfig(max_num_batched_tokens=64, gpu_memory_utilization=0.5)
    monkeypatch.setattr(kv_budget, "device_memory", lambda on_gpu: (8 * 10**9, "device memory"))
    monkeypatch.setattr(kv_budget, "held_bytes", lambda model: 10**9)
    monkeypatch.setattr(kv_budget, "free_device_bytes", lambda on_gpu: 7 * 10**9)  # nothing else: the fraction fits
    full = kv_budget.kv_cache_budget(config, model, body, head, on_gpu=True)
    assert "lowered" not in full.how
    monkeypatch.setattr(kv_budget, "free_device_bytes", lambda on_gpu: 3 * 10**9)  # another process took 4 GB
    budget = kv_budget.kv_cache_budget(config, model, body, head, on_gpu=True)
    peak = 4 * 10**9 - 10**9 - full.nbytes
    assert abs(budget.nbytes - (3 * 10**9 - peak - kv_budget.FREE_MARGIN)) < 2**20
    assert "lowered to" in budget.how and "3.00 GB free on the device (other processes hold 4.00 GB)" in budget.how


def test_a_given_pool_that_does_not_fit_in_free_memory_is_refused_by_name(monkeypatch):
    model = make_model("llama")
    monkeypatch.setattr(kv_budget, "free_device_bytes", lambda on_gpu: 3 * 10**9)
    config = EngineConfig(kv_cache_memory_gb=2.5)
    with pytest.raises(ValueError, match=r"kv_cache_memory_gb 2.5 \(--kv-cache-gb\) does not fit: 3.00 GB are free"):
        kv_budget.kv_cache_budget(config, model, *split_lm_head(model), on_gpu=True)
    config = EngineConfig(kv_cache_memory_gb=1.5)
    assert kv_budget.kv_cache_budget(config, model, *split_lm_head(model), on_gpu=True).nbytes == 15 * 10**8


OUT_OF_MEMORY = "cudaMallocAsync(&data, size, stream) failed: out of memory"


def test_an_allocator_out_of_memory_at_the_pool_says_what_to_change(monkeypatch):
    from pagedmlx.runner import model as runner_model

    real = runner_model.ModelRunner.make_pool

    def make_pool(runner, kv_cache_config, quantized=True):  # the engine's pool only, not the check's scratch pages
        if kv_cache_config is runner.kv_cache_config:
            raise RuntimeError(OUT_OF_MEMORY)
        return real(runner, kv_cache_config, quantized)

    monkeypatch.setattr(runner_model.ModelRunner, "make_pool", make_pool)
    with pytest.raises(ValueError, match=r"the KV pool \(0.01 GB\) could not be allocated .*--gpu-memory-utilization"):
        LLM(make_model("llama"), None, kv_cache_memory_gb=0.01)


def test_out_of_memory_in_the_load_time_check_is_not_called_a_wrong_model(monkeypatch):
    from pagedmlx.runner import verify

    def check(runner):
        raise RuntimeError(OUT_OF_MEMORY)

    monkeypatch.setattr(verify, "check_paged_forward", check)
    with pytest.raises(ValueError, match="the model's load-time check ran out of device memory") as refused:
        LLM(make_model("llama"), None, kv_cache_memory_gb=0.01)
    assert "different logits" not in str(refused.value)
