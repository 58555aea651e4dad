# bunshin — developer entry points. Everything runs as root on Debian 12/13.
#   make install   system packages, private CRIU >= 4.2, .venv, `bunshin` on PATH
#   make test      lint (ruff, mypy, import-linter), then the whole test suite (unit + integration,
#                  needs root and CRIU; without them those tests skip and say why)
#   make demo      the end-to-end demo
#   make lint      ruff, mypy (strict on the core layers), import-linter contracts
#   make bench     runtime micro-benchmarks
# Every target first runs `install`, which takes seconds once everything is in place.
# Extra pytest arguments: make test PYTEST_ARGS='-k fork -x'

ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV := $(ROOT)/.venv
PYTEST_ARGS ?=

.PHONY: install test demo lint check bench

install:
	@bash $(ROOT)/scripts/install.sh

test: install check
	cd $(ROOT) && $(VENV)/bin/python -m pytest -q -rs --durations=15 $(PYTEST_ARGS)

demo: install
	cd $(ROOT) && $(VENV)/bin/bunshin demo

lint: install check

# The static checks, without the install step (the targets above run it first).
check:
	cd $(ROOT) && $(VENV)/bin/ruff check bunshin tests
	cd $(ROOT) && $(VENV)/bin/mypy
	cd $(ROOT) && $(VENV)/bin/lint-imports --no-cache

bench: install
	cd $(ROOT) && $(VENV)/bin/bunshin bench runtime
