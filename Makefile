# The whole set-up on a fresh machine is `make run` or `make test`.
# `make bench` runs every benchmark; `make bench BENCH_ARGS="--only peers --quick"` one of
# them, briefly (see benchmarks/__main__.py).
PYTHON ?= python3
BENCH_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: run test tools lint imports deps typecheck pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# Running needs pipework and its runtime dependencies only, not the test tools.
$(RUN_STAMP): pyproject.toml
	@echo "make run: installing pipework and its runtime dependencies into $(VENV) (once)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade --progress-bar off pip
	$(BIN)/python -m pip install --progress-bar off -e .
	touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m examples.gateway.run

test: tools lint imports deps typecheck pytest

tools:
	scripts/ensure-tools

lint: $(STAMP)
	$(BIN)/ruff check pipework tests benchmarks examples
	$(BIN)/ruff format --check pipework tests benchmarks examples

imports: $(STAMP)
	$(BIN)/lint-imports

deps: $(STAMP)
	$(BIN)/deptry .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	scripts/ensure-bench-tools
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .tools build *.egg-info
