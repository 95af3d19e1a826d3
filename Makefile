# Developer commands. On a fresh machine: `make demo`, `make test`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install demo test lint bench

# Create .venv and install the package with its dev extra.
install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]'
	touch $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(MAKE) install

# Run the end-to-end demo (starts its own Redis when none answers).
demo: $(INSTALLED)
	$(BIN)/python -m celery_tooleffect.demo

# The test command (needs a Redis at 127.0.0.1:6379).
test: $(INSTALLED)
	$(BIN)/python -m pytest -q

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy --strict -p celery_tooleffect

# The benchmarks beside plain Celery (about 6 minutes; see bench/README.md).
bench: $(INSTALLED)
	$(BIN)/python -m bench
