# Two entry points that do all of their own set-up on a fresh machine:
#   make run   - relay on the embedded default config (config/relay.toml)
#   make test  - ruff, mypy --strict and pytest
#   make fuzz  - the atheris harnesses in fuzz/ for FUZZ_SECONDS each (own venv: fuzz/.venv)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

FUZZ_SECONDS ?= 30

.PHONY: run test lint typecheck pytest fuzz clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "relay needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/relay serve --config config/relay.toml

lint: $(STAMP)
	$(BIN)/ruff check relay tests $(wildcard bench fuzz)
	$(BIN)/ruff format --check relay tests $(wildcard bench fuzz)

typecheck: $(STAMP)
	$(BIN)/mypy relay tests

pytest: $(STAMP)
	$(BIN)/pytest

test: lint typecheck pytest

fuzz:
	PYTHON=$(PYTHON) bash fuzz/run.sh $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache fuzz/.venv fuzz/corpus fuzz/crashes
