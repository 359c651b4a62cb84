# `make demo` and `make test` set everything up on a fresh machine (see scripts/setup.sh).
VENV ?= .venv
BENCH_VENV ?= .venv-bench

.PHONY: setup demo test bench lint

setup:
	@VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(VENV)/bin/cswap demo

test: setup
	$(VENV)/bin/python -m pytest -q

# The benchmarks' own environment: torchtune's torchao pin would break peft in .venv.
bench:
	@VENV=$(BENCH_VENV) EXTRAS=bench,hf,dali bash scripts/setup.sh
	$(BENCH_VENV)/bin/cswap bench step --out benchmarks/results/step-$$(date +%F)-$$(hostname)

lint: setup
	$(VENV)/bin/ruff check cswap_lightning tests
