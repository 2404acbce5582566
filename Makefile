# The two commands of the README. Both create/update .venv first (idempotent, see tools/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup run test lint bench clean
setup:
	@VENV=$(VENV) tools/setup_env.sh

## make run: the default training run (builds the tiny base on first use). ARGS="key=value ..." overrides.
run: setup
	$(PY) -m vapo_async.learner $(ARGS)

## make test: the whole test suite.
test: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV) .pytest_cache
