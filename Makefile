# `make test` and `make demo` set up .venv by themselves. The stamp file makes a second `make setup` a no-op.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moezoo-installed
# The CPU build of torch that lies on this machine's disk; installed first so no CUDA build is pulled.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test test-fast demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[train,kernels,test]"
	touch $(STAMP)

# One worker per core; a file's tests stay on one worker so its module fixtures are built once.
test: setup
	$(PY) -m pytest -n auto --dist loadfile

test-fast: setup
	$(PY) -m pytest -n auto --dist loadfile -m "not slow"

demo: setup
	$(VENV)/bin/moezoo demo

bench: setup
	$(VENV)/bin/moezoo bench moe-layer

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info demo_output
