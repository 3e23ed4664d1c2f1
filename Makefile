# Two commands on a fresh machine: `make train` (the main job) and `make test` (the suite;
# `make test-slow` runs its slow tier).
# Both first build .venv with the CPU install path (torch pinned to 2.13.0).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test test-slow

$(VENV)/.installed: requirements-cpu.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-cpu.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

train: $(VENV)/.installed
	$(PY) jobs/train_gpt.py $(ARGS)

# Lint first (ruff format --check, ruff check: pyproject.toml's [tool.ruff]); then two workers: every Ray
# test on one of them (one local Ray a run), the in-process tests on both (tests/conftest.py groups them).
test: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist loadgroup $(ARGS)

# The slow tier, which `make test` leaves out: tests that start a Ray cluster or head of their own.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -m slow $(ARGS)
