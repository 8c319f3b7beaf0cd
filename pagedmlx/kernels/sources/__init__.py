"""The kernels' source texts, one module per kernel: `<kernel>.py` in the portable dialect
(kernels/dialect.py, rendered for CUDA and Metal alike), `<kernel>_cuda.py` in CUDA's own
(tensor cores, PTX). kernels/<kernel>.py builds and launches each."""
