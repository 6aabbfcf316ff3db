# `make test` and `make demo` set up .venv by themselves. The stamp file makes a second `make setup` a no-op.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moezoo-installed
# The CPU build of torch that lies on this machine's disk; installed first so no CUDA build is pulled.
TORCH_SPEC ?= torch==2.13.0
# The exact versions CI last passed with; pyproject.toml's ranges stay open for library users.
CONSTRAINTS := constraints.txt
UPGRADE_VENV := .venv-upgrade

.PHONY: setup test test-fast demo bench gpu-check upgrade-check clean

setup: $(STAMP)

# The last step unpacks the installed transformers' common model tests (not shipped in its wheel) into the venv.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[train,kernels,test]"
	$(PY) tests/transformers_tests/fetch.py
	touch $(STAMP)

# One worker per core; a file's tests stay on one worker so its module fixtures are built once.
test: setup
	$(PY) -m pytest -n auto --dist loadfile --durations=25

# The edit-test loop, in about two minutes: unit tests of the MoE core, configs, processors, the converters on the
# tiniest sources and the train commands' options. `make test` (CI) stays the whole suite.
FAST_TESTS := $(addprefix tests/test_,$(addsuffix .py,\
	moe_core smoes_core expert_lora moemb_flops mote_routing import_graph bench_timing \
	processor_journeys processor_bad_input core_journeys data_journeys mote_journeys moe_vie_journeys \
	moemb_processor conformance_processors conformance_processors_moemb conformance_processors_mote \
	conformance_processors_omnimoe_vl conformance_processors_smoes omnimoe_vl_presets \
	native_experts smoes_model moemb_model omnimoe_vl_model mixed_precision conversion_messages conversion_cost \
	smoes_conversion mote_conversion moe_vie_conversion moemb_conversion omnimoe_vl_conversion moemb_expert_pruning \
	training_arguments))

test-fast: setup
	$(PY) -m pytest -n auto --dist loadfile -m "not slow" --durations=10 $(FAST_TESTS)

demo: setup
	$(VENV)/bin/moezoo demo

bench: setup
	$(VENV)/bin/moezoo bench moe-layer

# On a machine with a CUDA GPU: the GPU tests and benchmarks in one run of under 8 minutes, without network access;
# the report (gpu_check.md, gpu_check.json and each step's log) goes to $(GPU_CHECK_OUT).
GPU_CHECK_OUT ?= gpu_check_output
gpu-check: setup
	$(VENV)/bin/moezoo bench gpu-check --out $(GPU_CHECK_OUT)

# The newest versions pyproject.toml allows, in a scratch venv, against the whole suite (transformers' common tests
# of the new version included): a new release is met on purpose. On success, the tested set is written beside it.
upgrade-check:
	rm -rf $(UPGRADE_VENV)
	$(PYTHON) -m venv $(UPGRADE_VENV)
	$(UPGRADE_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(UPGRADE_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[train,kernels,test]"
	$(UPGRADE_VENV)/bin/python tests/transformers_tests/fetch.py
	$(UPGRADE_VENV)/bin/python -m pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/' \
		> $(UPGRADE_VENV)/freeze.txt
	@echo "versions that differ from $(CONSTRAINTS):"
	@grep -v '^#' $(CONSTRAINTS) | diff - $(UPGRADE_VENV)/freeze.txt || true
	$(UPGRADE_VENV)/bin/python -m pytest -n auto --dist loadfile
	{ grep '^#' $(CONSTRAINTS); cat $(UPGRADE_VENV)/freeze.txt; } > $(UPGRADE_VENV)/constraints.txt
	@echo "the suite passes with these versions: cp $(UPGRADE_VENV)/constraints.txt $(CONSTRAINTS) to adopt them"

clean:
	rm -rf $(VENV) $(UPGRADE_VENV) build *.egg-info src/*.egg-info demo_output
