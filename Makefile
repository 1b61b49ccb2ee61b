# The two commands a new user needs: `make demo` (the main job on an embedded
# default, on this machine's CPU) and `make test` (the CPU test suite).
# Everything runs from .venv, created by `make setup` on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test demo lint bench test-slurm clean

# curl: the prep/ scripts download with it, and their tests run them for real.
setup: $(STAMP)
	@command -v curl >/dev/null || { echo "make setup: curl is missing (prep/*.sh and their tests use it): apt-get install curl" >&2; exit 1; }

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -r requirements.txt -r requirements-test.txt
	touch $(STAMP)

# A skip that README.md's "Expected skips" does not list fails the run (--fail-on-skip);
# `make test TEST_FLAGS=` runs without that rule.
TEST_FLAGS ?= --fail-on-skip
test: setup
	$(PY) tests/run.py $(TEST_FLAGS)

demo: setup
	$(PY) demo.py

lint: setup
	$(PY) -m compileall -q *.py tests bench
	$(VENV)/bin/shellcheck -x env.sh central.sh sites/*.sh jobs/*.sh prep/*.sh

# Every figure of bench/, each against a baseline measured in the same run.
# convergence.py runs its --quick size here (~4 min); the full size (~20 min) is
# `$(PY) bench/convergence.py`.
bench: setup
	@set -e; for b in bench/*.py; do \
	  echo "== $$b"; \
	  if [ "$$b" = bench/convergence.py ]; then $(PY) $$b --quick; else $(PY) $$b; fi; \
	done

# Runs every job script under a real single-node Slurm on this machine (needs root).
test-slurm: setup
	$(PY) tests/run.py slurm_jobs

clean:
	rm -rf runs/demo runs/bench-convergence
