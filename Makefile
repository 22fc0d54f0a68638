# tdfunc developer commands. Every target sets up .venv on first use (reused afterwards).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed-test
BSTAMP := $(VENV)/.installed-bench

.PHONY: setup setup-bench test fuzz demo bench bench-quick lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,lint,progress,safetensors,tensordict,transformers]' $(TORCH)
	touch $@

$(BSTAMP): $(STAMP)
	$(PIP) install -q -e '.[test,bench,lint,progress,safetensors,tensordict,transformers]' $(TORCH)
	touch $@

setup: $(STAMP)

setup-bench: $(BSTAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules tdfunc tests

# a long run of the program fuzzer (make test runs a few hundred programs; this thousands)
fuzz: $(STAMP)
	TDFUNC_FUZZ_EXAMPLES=$${TDFUNC_FUZZ_EXAMPLES:-3000} $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py

demo: $(STAMP)
	@set -e; for f in examples/*.py; do echo "== $$f"; $(PY) $$f; done

bench: $(BSTAMP)
	$(PY) -m compile_benchmarks.run --full

bench-quick: $(BSTAMP)
	$(PY) -m compile_benchmarks.run --quick

LINT_PATHS := tdfunc tests examples compile_benchmarks

# ruff (rules in pyproject.toml), the formatter in check mode, and mypy over tdfunc/.
# Every step runs, so one report lists all problems; the target fails if any step failed.
lint: $(STAMP)
	@rc=0; \
	$(PY) -m ruff check --output-format concise $(LINT_PATHS) || rc=1; \
	$(PY) -m ruff format --check --output-format concise $(LINT_PATHS) || rc=1; \
	$(PY) -m mypy || rc=1; \
	exit $$rc

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
