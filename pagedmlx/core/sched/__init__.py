"""Scheduling (vLLM's vllm/v1/core/sched): Scheduler (scheduler.py) and the step's batch it hands the runner
(output.py)."""
