from pagedmlx.platform import import_mlx_lm

import_mlx_lm()  # before any module of this package imports mlx-lm (see platform.import_mlx_lm)
