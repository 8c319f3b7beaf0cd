"""What a launcher (mlx.launch, mpirun) told this process through its environment: read before MLX
is imported (`pagedmlx serve` decides from it whether to start an engine-core process)."""

from __future__ import annotations

from typing import Optional

from pagedmlx import envs

# Environment a launcher sets, by backend (mlx.launch: MLX_RANK + MLX_HOSTFILE for ring, ...).
_LAUNCH_ENV = (("MLX_JACCL_COORDINATOR", "jaccl"), ("MLX_IBV_DEVICES", "jaccl"), ("NCCL_HOST_IP", "nccl"),
               ("MLX_HOSTFILE", "ring"), ("OMPI_COMM_WORLD_SIZE", "mpi"), ("PMI_SIZE", "mpi"))


def launched_rank() -> Optional[int]:
    """This process's rank as a launcher numbered it, or None (no launcher, or one that does not say)."""
    for var in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = getattr(envs, var) or ""
        if value.isdigit():
            return int(value)
    return None


def launched_backend() -> Optional[str]:
    """The backend a launcher (mlx.launch, mpirun) started this process for, or None."""
    for var, backend in _LAUNCH_ENV:
        if getattr(envs, var):
            return backend
    return None
