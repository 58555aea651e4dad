# bunshin — developer entry points. Everything runs as root on Debian 12/13.
#   make install   what the tests need: system packages, private CRIU >= 4.2, .venv with every extra
#                  (test, docs, adapters, cluster, desktop, e2b), `bunshin` on PATH
#   make install-core     the core alone (library, CLI, server): no torch, TRL, Ray, browsers or desktop apps
#   make install-adapters | install-cluster | install-desktop | install-docs | install-e2b   core + that extra
#   make test      the static checks and the docs build, then the whole test suite (unit + integration,
#                  needs root and CRIU; without them those tests skip and say why)
#   make demo      the end-to-end demo
#   make lint      ruff, mypy (strict on the core layers), import-linter contracts
#   make docs      the documentation site (mkdocs build --strict) into site/
#   make bench     runtime micro-benchmarks
# Every target first runs `install`, which takes seconds once everything is in place.
# Extra pytest arguments: make test PYTEST_ARGS='-k fork -x'

ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV := $(ROOT)/.venv
PYTEST_ARGS ?=
# Test workers (pytest-xdist; tests/conftest.py gives each a file whole): make test TEST_WORKERS=0 runs them in one process
TEST_WORKERS ?= 2
EXTRAS := adapters cluster desktop docs e2b
# Material and MkDocs print a banner about MkDocs 2 on every build: not a warning about this site
export NO_MKDOCS_2_WARNING := 1
export DISABLE_MKDOCS_2_WARNING := true

.PHONY: install install-core $(addprefix install-,$(EXTRAS)) test demo lint check docs bench

install:
	@BUNSHIN_INSTALL_PROFILE=all bash $(ROOT)/scripts/install.sh

install-core:
	@BUNSHIN_INSTALL_PROFILE=core bash $(ROOT)/scripts/install.sh

$(addprefix install-,$(EXTRAS)): install-%:
	@BUNSHIN_INSTALL_PROFILE=$* bash $(ROOT)/scripts/install.sh

test: install check
	cd $(ROOT) && $(VENV)/bin/python -m pytest -q -rs --durations=15 -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: install
	cd $(ROOT) && $(VENV)/bin/bunshin demo

lint: install check

# The static checks and the docs build, without the install step (the targets above run it first).
check:
	cd $(ROOT) && $(VENV)/bin/ruff check bunshin tests
	cd $(ROOT) && $(VENV)/bin/mypy
	cd $(ROOT) && $(VENV)/bin/lint-imports --no-cache
	cd $(ROOT) && $(VENV)/bin/python -m bunshin.bench.results readme --check
	cd $(ROOT) && $(VENV)/bin/mkdocs build --strict --quiet

docs: install
	cd $(ROOT) && $(VENV)/bin/mkdocs build --strict

bench: install
	cd $(ROOT) && $(VENV)/bin/bunshin bench runtime
