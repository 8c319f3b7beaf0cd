"""When each request of `bench serve` is sent, as vLLM's `get_request`: all at once at rate inf;
otherwise intervals drawn from a gamma distribution of shape `burstiness` and mean 1 / rate, which
is a Poisson process at burstiness 1 (exponential intervals); below 1 arrivals come in bursts, above 1
they are more even (the intervals' coefficient of variation is 1 / sqrt(burstiness)); at burstiness
inf every interval is exactly 1 / rate. As vLLM does, the times are then scaled so that the last one
falls at num_requests / rate, which keeps the offered load the same from one seed to the next."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each request is sent (non-decreasing)."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        intervals = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(intervals)
    return times * (num_requests / request_rate / times[-1])
