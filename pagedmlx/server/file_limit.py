"""The open-file limit of a serving process: each connection holds a file descriptor.

mlx-lm sets RLIMIT_NOFILE to (2048, 4096) when `mlx_lm.utils` is imported, whatever the operator
set: it lowers a higher hard limit for good (an unprivileged process cannot raise it back), and it
fails with ValueError, so the server does not start at all, under a hard limit below 4096."""

from __future__ import annotations

import resource

__all__ = ["RESERVED_FDS", "default_max_connections", "raise_file_limit"]

RESERVED_FDS = 256  # model files, pipes, the engine's own: kept out of the connection cap
DEFAULT_MAX_CONNECTIONS = 4096


def raise_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (where the system allows it); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit (macOS) still caps the soft one: try a large value, then OPEN_MAX.
    for target in [hard] if hard != resource.RLIM_INFINITY else [1 << 20, 10240]:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def default_max_connections(soft_limit: int) -> int:
    return max(16, min(DEFAULT_MAX_CONNECTIONS, soft_limit - RESERVED_FDS))
