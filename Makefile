# Two entry points that do all of their own set-up on a fresh machine:
#   make run   - relay on the embedded default config (config/relay.toml)
#   make test  - ruff, mypy --strict and pytest
#   make fuzz  - the atheris harnesses in fuzz/ for FUZZ_SECONDS each (own venv: fuzz/.venv)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

FUZZ_SECONDS ?= 30

.PHONY: run test lint typecheck pytest fuzz clean redis-server bench

# Debian and Ubuntu ship python3 without ensurepip, which `python3 -m venv` needs: install its
# python3.X-venv package when it is missing (apt-get, with sudo unless root), as for redis-server.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "relay needs Python >= 3.11")'
	@$(PYTHON) -c 'import ensurepip' >/dev/null 2>&1 || { \
	  PKG=python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv; \
	  if [ "$$(id -u)" -eq 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  echo "installing $$PKG (apt-get): $(PYTHON) -m venv needs it"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$PKG \
	  || { $$SUDO apt-get update -q \
	       && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$PKG; }; \
	}
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/relay serve --config config/relay.toml

# make bench - relay side by side with direct and nginx (bench/README.md); PROFILE=1 adds a
#              py-spy profile, BENCH_ARGS passes options to `python -m bench.run`.
BENCH_VENV  := bench/.venv
BENCH_STAMP := $(BENCH_VENV)/.installed

.PHONY: bench bench-pyinstrument

$(BENCH_STAMP): bench/requirements.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet -r bench/requirements.txt
	touch $(BENCH_STAMP)

# make bench-pyinstrument - relay's hot path in-process under pyinstrument (bench/micro.py);
#              installs pyinstrument into relay's venv (a profiling tool, not a dependency).
bench-pyinstrument: $(STAMP)
	$(BIN)/pip install --quiet pyinstrument==5.1.3
	$(BIN)/python -m bench.micro --pyinstrument bench/results/micro-pyinstrument

bench: $(STAMP) $(BENCH_STAMP)
	bench/tools.sh
	$(BENCH_VENV)/bin/python -m bench.run $(if $(PROFILE),--profile) $(BENCH_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check relay tests $(wildcard bench fuzz)
	$(BIN)/ruff format --check relay tests $(wildcard bench fuzz)

typecheck: $(STAMP)
	$(BIN)/mypy relay tests bench

# The route-feed tests start their own redis-server (loopback, free port, temp dir); install
# it when missing (Debian/Ubuntu), with sudo unless root. Its packaged service is not used.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" -eq 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  echo "installing redis-server (apt-get)"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server \
	  || { $$SUDO apt-get update -q \
	       && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }; \
	}

pytest: $(STAMP) redis-server
	$(BIN)/pytest

test: lint typecheck pytest

fuzz:
	PYTHON=$(PYTHON) bash fuzz/run.sh $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache fuzz/.venv fuzz/corpus fuzz/crashes
