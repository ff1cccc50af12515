# Two commands a fresh machine needs (each installs what it uses on first run):
#   make serve   the whole mesh on the embedded default models
#   make test    lint, contract checks and the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: serve test lint install

$(BIN)/stagemesh: pyproject.toml package-lock.json
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	npm ci --silent --no-audit --no-fund
	touch $@

install: $(BIN)/stagemesh

serve: install
	$(BIN)/stagemesh serve

lint: install
	node_modules/.bin/buf lint
	node_modules/.bin/buf format --diff --exit-code
	$(BIN)/python tools/genproto.py --check
	$(BIN)/ruff check .
	tools/check_k8s.sh

test: lint
	$(BIN)/pytest
