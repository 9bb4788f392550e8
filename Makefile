# Two commands do all the set-up on a fresh machine (see README.md):
#   make quickstart   the main job: notebooks/01-quickstart.ipynb on 2 local ranks
#   make test         lint, types and the whole test suite (real kernels, Spark, a browser)
# While developing (docs/developing.md):
#   make check        lint, types and the fast tests: the loop to run after every change

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

# Python writes the bytecode of what it imports, once, as on any machine: this kind of machine
# sets PYTHONDONTWRITEBYTECODE, and every rank, kernel and worker compiled torch's sources
# again (a fresh clone's suite ran at half its speed). Compiling all of it at install instead
# (uv's --compile-bytecode, pip's default) took 4 minutes of CPU for 25,000 files, most of them
# never imported by a test (docs/developing.md).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup quickstart test coverage check lint system-deps bench matrix

setup: $(VENV)/.installed

# torch is pinned for development only (.ci/constraints.txt): any other version or range makes
# pip download a multi-GB CUDA build on this kind of machine. uv installs (43 s here from an
# empty cache, where pip took 4 min); it is told where pip finds local wheels (PIP_FIND_LINKS:
# torch's CPU build on this kind of machine). The tf and jax extras (the Keras tests and
# notebook) leave torch and numpy as they are.
EXTRAS := dev,torch,spark,connect,tf,jax,mlflow,data,ray
UV      = $(VENV)/bin/uv pip install --quiet --python $(PY) \
	  $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	$(UV) -c .ci/constraints.txt torch -e '.[$(EXTRAS)]'
	.ci/bytecode $(PY)
	touch $@

quickstart: setup
	$(PY) notebooks/run.py notebooks/01-quickstart.ipynb

lint: setup
	$(VENV)/bin/ruff check nbdist tests benchmarks notebooks
	$(VENV)/bin/mypy

# Java 17 for Spark, Debian's chromium for the browser test, iproute2 (`ip netns`) for the
# multi-host tests (tests/multihost, which also need root); root installs them with apt-get.
system-deps:
	@command -v java >/dev/null || { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }
	@command -v ip >/dev/null || { apt-get update -qq && apt-get install -y -qq iproute2; }
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }

# The fast loop: every test not marked slow (a test that took more than 3 s when measured;
# docs/developing.md), spark or browser. Real ranks still run; Spark and the browser do not.
check: lint
	$(PY) -m pytest -q -m "not slow and not spark and not browser"

# The whole suite in WORKERS pytest-xdist workers (4; most of it waits on ranks, kernels and
# JVMs), then the Ray tests with the version matrix's legs beside them, lint beside the workers:
# .ci/suite says in what order and why. What only one process may hold (Spark, Ray, the
# multi-host tests' hosts, the browser) runs in one worker each (tests/conftest.py,
# XDIST_GROUPS). Coverage is not measured here: measured in every rank, zygote and kernel it
# took 1.7 times the CPU on 2 cores, which CI's budget cannot hold; `make coverage` measures it.
WORKERS ?= 4
test: setup system-deps
	@WORKERS=$(WORKERS) PY=$(PY) .ci/suite

# The same suite (without the matrix) with coverage measured in every process the tests start:
# ranks (fresh interpreters, or forks of a zygote), zygotes, kernels, Spark's Python workers
# ([tool.coverage.run] in pyproject.toml). A process killed while it was creating its data file
# (the fault tests kill ranks) leaves it empty: dropped. .coverage stays for
# `.venv/bin/coverage html`.
coverage: setup system-deps
	rm -f .coverage .coverage.*
	@WORKERS=$(WORKERS) PY=$(PY) .ci/suite --coverage; status=$$?; \
	find . -maxdepth 1 -name '.coverage.*' -empty -delete; \
	$(VENV)/bin/coverage combine --quiet && $(VENV)/bin/coverage report; exit $$status

# The version matrix alone (docs/developing.md): a fast subset on Python 3.10 (ipykernel 6,
# IPython 8), 3.12 (ipywidgets 7) and 3.13, and the Spark tests with pyspark 3.5; `make matrix
# LEGS=spark35` runs one leg.
LEGS ?=
matrix: setup system-deps
	.ci/matrix $(LEGS)

# Benchmarks (not part of the tests): every contender in the same run, medians and ratios.
bench: setup system-deps
	$(UV) -c .ci/constraints.txt -e '.[$(EXTRAS),bench]'
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run.py
