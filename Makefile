# pagedmlx: `make serve` sets everything up and serves; `make test` sets everything up and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# MLX's Linux CPU wheel links a reference BLAS; OpenBLAS (Debian: libopenblas0-pthread) is ~50x faster.
# Looked up when a command runs, not when make starts: on a fresh machine `setup` installs it first.
RUN := LD_PRELOAD="$$(ls /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0 2>/dev/null | head -n 1)"
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=

.PHONY: setup test test-all lint serve demo bench clean

$(VENV)/.installed: pyproject.toml
	@scripts/install_blas.sh || true
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The vision extra without its own dependencies (audio, datasets, opencv: ~250 MB the image path never imports)
	$(PY) -m pip install -q --no-deps "mlx-vlm==0.7.10"
	touch $@

setup: $(VENV)/.installed

# What CI runs (a few minutes on 2 cores, two test workers); `make test-all` adds the slow, stress and GPU tests
# (GPU ones skip where there is none).
WORKERS ?= 2
test: lint
	$(RUN) $(PY) -m pytest -n $(WORKERS) -m "not slow and not stress and not gpu" $(ARGS)

test-all: lint
	$(RUN) $(PY) -m pytest -n $(WORKERS) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

serve: setup
	$(RUN) $(VENV)/bin/pagedmlx serve --host $(HOST) --port $(PORT) $(MODEL) $(ARGS)

demo: setup
	$(RUN) $(VENV)/bin/pagedmlx generate $(MODEL) --prompt "What is the capital of France?" $(ARGS)

bench: setup
	$(RUN) $(PY) scripts/bench/bench_offline.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
