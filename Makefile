# The two commands a new user needs: `make demo` (the main job on an embedded
# default, on this machine's CPU) and `make test` (the CPU test suite).
# Everything runs from .venv, created by `make setup` on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup lumi-api browser netpeers test demo lint bench bench-faults chaos test-slurm clean

# curl: the prep/ scripts download with it, and their tests run them for real.
setup: $(STAMP)
	@command -v curl >/dev/null || { echo "make setup: curl is missing (prep/*.sh and their tests use it): apt-get install curl" >&2; exit 1; }

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -r requirements.txt -r requirements-test.txt
	touch $(STAMP)

# The LUMI image's torch (an older one than requirements.txt's: the newest LUMI-G's
# driver runs), in a venv of its own under .venv, for tests/test_lumi_api.py: a pin that CI
# never imports is a guess. Built once by `make test` (~7.5 GB, ~3.5 min from PyPI), never
# by `make demo`; a new pin in requirements-lumi-api.txt reinstalls.
LUMI_VENV  := $(VENV)/lumi-api
LUMI_STAMP := $(LUMI_VENV)/.installed
LUMI_NEED_GB := 9

lumi-api: $(LUMI_STAMP)

$(LUMI_STAMP): requirements-lumi-api.txt | $(STAMP)
	@$(PY) -c "import shutil, sys; free = shutil.disk_usage('$(VENV)/').free / 2**30; \
	  sys.exit(0 if free >= $(LUMI_NEED_GB) else 'make: $(LUMI_VENV) (the LUMI torch for make test) needs ' \
	  '$(LUMI_NEED_GB) GB free under $(VENV), %.1f GB are: free some space, or run make setup && .venv/bin/python tests/run.py' % free)"
	$(PYTHON) -m venv $(LUMI_VENV)
	$(LUMI_VENV)/bin/pip install --no-cache-dir --disable-pip-version-check -r requirements-lumi-api.txt
	touch $(LUMI_STAMP)

# Debian's headless Chromium and its chromedriver, and the text browser w3m, for
# tests/test_status_page.py's renders of the status page (~300 MB). `make test` installs them
# once (apt-get, as root, as CI runs); elsewhere it says the one command to run. `make demo`
# never needs them.
BROWSERS := chromium chromium-driver w3m
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] || [ ! -x /usr/bin/w3m ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y $(BROWSERS) || { apt-get update && apt-get install -y $(BROWSERS); }; \
	  else \
	    echo "make test: the status page tests need Debian's browsers: sudo apt-get install -y $(BROWSERS)" >&2; exit 1; \
	  fi; \
	fi

# Debian's Squid, microsocks (a SOCKS5 server) and nginx, for the tests that put a site behind a
# real proxy and the central services behind one public port (tests/test_proxy.py,
# tests/test_front.py). Installed once, as `browser` does; never started by the package here (each
# test starts its own instance on its own addresses and stops it). `make demo` never needs them.
NETPEERS := squid microsocks nginx-light
netpeers:
	@if ! command -v squid >/dev/null || ! command -v microsocks >/dev/null || ! command -v nginx >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y $(NETPEERS) || { apt-get update && apt-get install -y $(NETPEERS); }; \
	  else \
	    echo "make test: the proxy and front tests need Debian's squid, microsocks and nginx: sudo apt-get install -y $(NETPEERS)" >&2; exit 1; \
	  fi; \
	  for s in squid nginx; do systemctl disable --now $$s 2>/dev/null || service $$s stop 2>/dev/null || true; done; \
	fi

# A skip that TESTING.md's "Expected skips" does not list fails the run (--fail-on-skip);
# `make test TEST_FLAGS=` runs without that rule. PWW_LUMI_API_VENV makes a missing LUMI
# venv a failure of tests/test_lumi_api.py, not a skip.
TEST_FLAGS ?= --fail-on-skip
# As root (as CI runs) the same run also takes tests/slurm_jobs.py (`make test-slurm`): every
# job script under a real one-node Slurm that tests/local_slurm.sh installs (apt-get, once)
# and starts, counted in the one summary. Not root, it is left out, and said so;
# `make test TEST_SLURM=` leaves it out as root too.
TEST_SLURM ?= $(if $(filter 0,$(shell id -u)),--with slurm_jobs)
test: setup browser netpeers $(LUMI_STAMP)
	@[ -n "$(TEST_SLURM)" ] || echo "make test: tests/slurm_jobs.py left out (it needs root: sudo make test-slurm)"
	PWW_LUMI_API_VENV=$(LUMI_VENV) $(PY) tests/run.py $(TEST_FLAGS) $(TEST_SLURM)

demo: setup
	$(PY) demo.py

lint: setup
	$(PY) -m compileall -q *.py testbed tests bench
	$(VENV)/bin/shellcheck -x env.sh central.sh sites/*.sh jobs/*.sh prep/*.sh tests/*.sh

# Every figure of bench/, each against a baseline measured in the same run; each bench's
# stdout is tee'd (it still prints) through bench/results.py, which rewrites that bench's
# block of bench/RESULTS.md (between <!-- bench:NAME --> and <!-- /bench:NAME -->) with the
# command, today's date and what it printed; the hand-written text around the blocks stays.
# A bench without its markers stops the run before any bench starts (results.py --check); a bench
# that fails leaves its block as it was. The raw output stays in runs/bench/NAME.out.
# convergence.py runs its --quick size here (~4 min); the full size (~20 min) is
# `$(PY) bench/convergence.py`. fault_schedule.py runs 40 schedules here (~7 min);
# the full proof (500 schedules, ~1.5 h on 2 cores) is `$(PY) bench/fault_schedule.py --jobs 2`.
# faults.py has its own target below; http_fuzz.py is a tool that faults.py drives (and an
# operator points at a test deployment), not a figure; wan_relay.py is the WAN-shaped link
# the benches import (wire_formats.py --link-mbit); results.py is the writer above.
# wire_formats.py (the wire formats, up and down, overlap off and on) runs 25 short federations,
# ~32 min on a quiet 2-core machine; `--no-sweep --no-ddp` runs 15. wan_tricks.py runs --quick here
# (2 seeds of f32 and int4 both ways and DDP, 8 rounds, ~5 min); the measurement bench/RESULTS.md
# quotes (3 seeds, 40+ rounds, every arm with its own outer setting, a second model size) is
# `$(PY) bench/wan_tricks.py --json wan.json` (~75 min).
# chaos.py runs its --quick setting here (3 min of faults, then the unfaulted run; ~10 min);
# `make chaos` is the 15-minute setting. scale_round.py runs --quick here (a ~24M-param model,
# 3 rounds, < 1 min); the sizes users train are `$(PY) bench/scale_round.py --flavor 0.6B` (~30 min).
# site_share.py runs --quick here (0.6B's layer shapes, 2 layers, 8192 vocabulary rows, 2 ranks; < 1 min);
# `$(PY) bench/site_share.py` is the 0.6B model (~9 GB of memory).
# hetero.py runs --quick here (1 seed: sites at 1:2, fixed H against phases in time, and a stalled
# site with and without the quorum; ~5 min); `$(PY) bench/hetero.py` is 3 seeds of 1:1, 1:2, 1:3,
# 1:2:3 and the stall at 30+ rounds (~3 h).
# wan_path.py runs --quick here (256 MiB; our client against curl, 1-8 streams, direct, through a
# real Squid and on a window-limited path; ~3 min); `$(PY) bench/wan_path.py` is 1 GiB (~10 min).
bench: SHELL := /bin/bash
bench: setup netpeers
	@set -eo pipefail; mkdir -p runs/bench; skip="bench/faults.py bench/http_fuzz.py bench/wan_relay.py bench/results.py"; \
	for b in bench/*.py; do case " $$skip " in *" $$b "*) continue ;; esac; $(PY) bench/results.py --check $$(basename $$b .py); done; \
	for b in bench/*.py; do \
	  case " $$skip " in *" $$b "*) continue ;; esac; \
	  name=$$(basename $$b .py); \
	  case "$$b" in \
	    bench/convergence.py) args="--quick" ;; \
	    bench/wan_tricks.py) args="--quick" ;; \
	    bench/wire_speed.py) args="--quick" ;; \
	    bench/chaos.py) args="--quick" ;; \
	    bench/scale_round.py) args="--quick" ;; \
	    bench/site_share.py) args="--quick" ;; \
	    bench/hetero.py) args="--quick" ;; \
	    bench/wan_path.py) args="--quick" ;; \
	    bench/fault_schedule.py) args="--schedules 40 --jobs 2" ;; \
	    *) args="" ;; \
	  esac; \
	  echo "== $$b $$args"; \
	  $(PY) $$b $$args | tee runs/bench/$$name.out; \
	  $(PY) bench/results.py $$name --command "python $$b$${args:+ $$args}" < runs/bench/$$name.out; \
	done

# What the central servers survive (SIGKILLs, fuzz, load, half-open connections, full
# disks; ~20 min; root for the tmpfs); rewrites its tables in bench/RESULTS.md.
bench-faults: setup
	$(PY) bench/faults.py

# Real training under random faults: two torchrun sites (FSDP and DDP, --overlap, int4 both
# ways, TLS) while every process is SIGKILLed and SIGSTOPped for 15 minutes, then the same
# corpus unfaulted; audit, theta replay, held-out loss, goodput (FEDERATION_GUIDE.md section 7,
# figures in bench/RESULTS.md).
# `make chaos CHAOS_FLAGS="--minutes 5 --seed 2"` for another setting.
CHAOS_FLAGS ?= --minutes 15
chaos: setup
	$(PY) bench/chaos.py $(CHAOS_FLAGS)

# Runs every job script under a real single-node Slurm on this machine (needs root; `make
# test` runs it too when root): tests/local_slurm.sh starts it (and `tests/local_slurm.sh
# stop` stops it afterwards).
test-slurm: setup
	$(PY) tests/run.py slurm_jobs

clean:
	rm -rf runs/demo runs/bench-convergence runs/fault_schedule runs/chaos
