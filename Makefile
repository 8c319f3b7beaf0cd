# pagedmlx: `make serve` sets everything up and serves; `make test` sets everything up and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# MLX's Linux CPU wheel links a reference BLAS; OpenBLAS (Debian: libopenblas0-pthread) is ~50x faster.
BLAS := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0))
export LD_PRELOAD := $(BLAS)
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=

.PHONY: setup test serve demo bench clean

$(VENV)/.installed: pyproject.toml
	@scripts/install_blas.sh || true
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest $(ARGS)

serve: setup
	$(VENV)/bin/pagedmlx serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

demo: setup
	$(VENV)/bin/pagedmlx generate $(if $(MODEL),--model $(MODEL)) --prompt "What is the capital of France?" --chat $(ARGS)

bench: setup
	$(PY) scripts/bench_offline.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
