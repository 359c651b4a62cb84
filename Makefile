# `make demo` and `make test` set everything up on a fresh machine (see scripts/setup.sh).
VENV ?= .venv
BENCH_VENV ?= .venv-bench

.PHONY: setup demo test test-fast test-oldest bench lint

setup:
	@VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(VENV)/bin/cswap demo

test: setup
	$(VENV)/bin/python -m pytest -q

# While developing: the suite without the tests marked slow (`make test` runs everything).
test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow"

# The suite on the oldest release of each dependency pyproject.toml allows (.venv-oldest;
# downloads torch's CUDA build, about 3 GB).
test-oldest:
	bash scripts/oldest.sh

# The benchmarks' own environment: torchtune's torchao pin would break peft in .venv.
bench:
	@VENV=$(BENCH_VENV) EXTRAS=bench,dali bash scripts/setup.sh
	$(BENCH_VENV)/bin/cswap bench step --out benchmarks/results/step-$$(date +%F)-$$(hostname)

lint: setup
	$(VENV)/bin/ruff check cswap_lightning tests examples
