# Developer commands. On a fresh machine: `make demo`, `make test`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install demo test test-unit test-fast lint bench celery-suite

# Create .venv and install the package with its dev extra.
install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]'
	touch $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(MAKE) install

# Run the end-to-end demo on Redis servers of its own (`make demo ARGS=--keep`
# leaves its data and prints the CLI and Flower commands to explore it).
demo: $(INSTALLED)
	$(BIN)/python -m celery_tooleffect.demo $(ARGS)

# pytest-xdist: the independent tests side by side. The one place these options
# live (.ci/run reads this line). The tests mostly wait on real processes, so
# more workers than cores pay off: -n 4 runs about 1,280 tests in about 16.5
# minutes on 2 cores (-n 6 was no faster, and flakier). `--dist loadgroup`
# keeps the tests of one xdist_group on one worker (see tests/conftest.py).
# A single test runs without them: .venv/bin/python -m pytest tests/test_x.py::test_y
PARALLEL ?= -n 4 --dist loadgroup

# The test command: the services first, then every test (about 16.5 minutes
# with PARALLEL on 2 cores), then the tests that run alone (about 2 minutes). The suite needs a
# Redis at 127.0.0.1:6379 (TOOLEFFECT_TEST_REDIS_URL names another),
# redis-server on PATH, a RabbitMQ at 127.0.0.1:5672 with rabbitmqctl, root
# and iproute2 (the partition test) and Chromium with chromedriver (the Flower
# page test): scripts/services.sh brings up what is missing (as root, with
# apt-get) and names what it cannot; the tests that need it are then skipped,
# and -rs lists each skip with its reason. README.md, "On a fresh machine".
test: $(INSTALLED)
	bash scripts/services.sh
	$(BIN)/python -m pytest -q -rs $(PARALLEL) -m "not alone"
	$(BIN)/python -m pytest -q -rs -m alone

# The service-free layer (tests/unit/): the decision logic in-process, with
# no Redis, RabbitMQ or process of its own, in seconds (a test there that
# tries to connect anywhere fails). `make test` runs it too.
test-unit: $(INSTALLED)
	$(BIN)/python -m pytest -q tests/unit

# Everything but the slow tests (> ~15 s each), the store fault scenarios
# (tests/faults/), the browser, Redis Cluster and RabbitMQ tests: needs a
# Redis (TOOLEFFECT_TEST_REDIS_URL, default 127.0.0.1:6379) and redis-server
# on PATH, nothing else.
test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not slow and not faults and not browser and not cluster and not rabbitmq"

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy --strict
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir /tmp/celery-tooleffect-site

# The benchmarks beside plain Celery, with the pools matrix (see bench/README.md).
bench: $(INSTALLED)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench

# Celery's own integration suite, plain and with task_cls=ToolTask, compared
# (compat/celery_suite/run.py; about 20 minutes; needs redis-server on PATH).
celery-suite: $(INSTALLED)
	$(BIN)/nox -s celery_suite
