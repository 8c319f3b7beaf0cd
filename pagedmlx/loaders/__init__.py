"""Model loaders, apart from model code: which loader a model argument picks (loaders/loader.py), GGUF files
(gguf*.py), GGUF models from PyPI (pypi_models.py) and random-weight models (random_model.py)."""

from pagedmlx.platform import import_mlx_lm

import_mlx_lm()  # before any module of this package imports mlx-lm (see platform.import_mlx_lm)
