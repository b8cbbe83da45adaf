# Set-up, tests and tools. Everything runs from the project's own venv (.venv),
# which `make venv` builds and every other target builds on demand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
PYTEST_ARGS ?=
# Tests run in this many pytest-xdist processes, a module's tests in one of them
# (its module-scoped world is started once). Most of a test is waiting on its
# workers, so two processes on two cores halve the wall time; 0 runs in-process.
PYTEST_WORKERS ?= 2

export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv test test-slow demo bench lint proto clean conformance

venv: $(STAMP)

# torch goes in first, alone and pinned, so that nothing resolves it to a
# CUDA build; the constraints keep it pinned through the second install.
# The stamp makes the venv reinstall whenever the dependencies change.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints.txt torch==2.13.0
	$(PY) -m pip install -c constraints.txt -e '.[dev,examples]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra --durations=10 -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# pytest exits 5 when nothing is selected; no slow test yet is not a failure.
test-slow: $(STAMP)
	$(PY) -m pytest -q -ra -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

demo: $(STAMP)
	$(PY) examples/param_server/main.py

bench: $(STAMP)
	$(PY) benchmarks/bench.py

# torch's own RPC test suites on torch and on rrpc (conformance/__init__.py);
# e.g. CONFORMANCE_ARGS="--suite dist_optimizer --framework rrpc".
CONFORMANCE_ARGS ?=
conformance: $(STAMP)
	$(PY) -m conformance $(CONFORMANCE_ARGS)

# lint-imports: the layers of ARCHITECTURE.md ([tool.importlinter] in
# pyproject.toml); tests/test_layers.py checks them too, for `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy rrpc
	$(VENV)/bin/lint-imports --no-cache

# Messages only (python_out): rrpc defines its own service handlers, so no
# grpc stubs are generated.
proto: $(STAMP)
	mkdir -p rrpc/_proto
	$(PY) -m grpc_tools.protoc -I proto --python_out=rrpc/_proto proto/rrpc.proto

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
