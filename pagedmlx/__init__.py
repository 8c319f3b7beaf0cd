"""pagedmlx: a paged-KV inference engine and OpenAI-compatible server for MLX."""

__version__ = "0.1.0"
