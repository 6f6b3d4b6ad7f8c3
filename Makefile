# Two entry points that do all of their own set-up on a fresh machine:
#   make run   - relay on the embedded default config (config/relay.toml)
#   make test  - ruff, mypy --strict and pytest
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck pytest clean redis-server

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "relay needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/relay serve --config config/relay.toml

lint: $(STAMP)
	$(BIN)/ruff check relay tests bench
	$(BIN)/ruff format --check relay tests bench

typecheck: $(STAMP)
	$(BIN)/mypy relay tests

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

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
