# Two commands a fresh machine needs (each installs what it uses on first run):
#   make serve      the whole mesh on the embedded default models
#   make test       lint (ruff, mypy --strict, contracts, manifests), then every test tier
# While working:
#   make test-fast  the unit tier only (no model, no gRPC server): seconds
#   make lint       the checks alone
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# dev: lint and test tools; bench: charts (`stagemesh bench`); train: progress bars (`stagemesh
# train`); voice-gpl: the default voice's phonemizer, video-gpl: the MP4 encoder (both GPL, see
# the README's licences).
EXTRAS := dev,bench,train,voice-gpl,video-gpl
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: serve test test-fast lint install

# An editable install (setup.py makes it a static path that mypy follows; new modules need no
# reinstall), with every extra.
$(BIN)/stagemesh: pyproject.toml setup.py package-lock.json
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	npm ci --silent --no-audit --no-fund
	touch $@

# The editable install's one symlink (see setup.py): remade if `build/` was cleaned.
build/__editable__/stagemesh: | $(BIN)/stagemesh
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .

# The playground's browser test drives Debian's Chromium: installed here when root and missing.
install: $(BIN)/stagemesh build/__editable__/stagemesh
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi

serve: install
	$(BIN)/stagemesh serve

# The checks of `make lint`, a target each so that they run two at a time: mypy, the longest
# (~3 min cold, as on CI), beside the others in turn (about a minute together); each check's
# output is printed whole when it ends, and every failing check is reported.
LINT_CHECKS := lint-mypy lint-protos lint-ruff lint-imports lint-k8s lint-clones
LINT_PARALLEL := $(MAKE) --no-print-directory --jobs=2 --output-sync=target --keep-going
.PHONY: $(LINT_CHECKS)

lint: install
	@$(LINT_PARALLEL) $(LINT_CHECKS)

lint-mypy:
	$(BIN)/mypy

lint-protos:
	node_modules/.bin/buf lint
	node_modules/.bin/buf format --diff --exit-code
	$(BIN)/python tools/genproto.py --check

lint-ruff:
	$(BIN)/ruff check .

lint-imports:
	$(BIN)/lint-imports

lint-k8s:
	tools/check_k8s.sh

lint-clones:
	node_modules/.bin/jscpd  # clones in gateway/ and services/: .jscpd.json, reasons in .jscpd.md

test-fast: install
	$(BIN)/pytest -m unit tests/unit

# The checks but lint-k8s, then every tier: pytest validates the same renders against the same
# schemas as tools/check_k8s.sh (tests/unit/test_k8s_manifests.py), so `make test` does it once.
test: install
	@$(LINT_PARALLEL) $(filter-out lint-k8s,$(LINT_CHECKS))
	$(BIN)/pytest
