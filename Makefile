# Two commands do all the set-up on a fresh machine (see README.md):
#   make quickstart   the main job: notebooks/01-quickstart.ipynb on 2 local ranks
#   make test         lint, types and the whole test suite (real kernels, Spark, a browser)
# While developing (docs/developing.md):
#   make check        lint, types and the fast tests: the loop to run after every change

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup quickstart test check lint system-deps bench matrix

setup: $(VENV)/.installed

# torch is pinned for development only (.ci/constraints.txt): any other version or range makes
# pip download a multi-GB CUDA build on this kind of machine. The tf and jax extras (the Keras
# tests and notebook) add about two minutes; they leave torch and numpy as they are.
$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c .ci/constraints.txt torch
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e '.[dev,torch,spark,connect,tf,jax,mlflow,data,ray]'
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

# The whole suite under coverage, measured in the ranks, zygotes, kernels and Spark workers the
# tests start too ([tool.coverage.run] in pyproject.toml), in WORKERS pytest-xdist workers: most
# of the suite waits on ranks, kernels and JVMs. What only one process may hold (Spark, Ray, the
# multi-host tests' hosts, the browser) runs in one worker each (tests/conftest.py, XDIST_GROUPS).
# The Ray tests (marker `ray`) run after the workers, alone: Ray 2.60's raylet gives its
# dashboard agent a fixed 15 s to start and aborts past it, which the workers' load exceeded in a
# fresh clone's run (every Ray test errored at the cluster's start; docs/ray.md).
# The version matrix (.ci/matrix) runs after it (beside it, its environments' installs and
# tests slowed the set-ups the groups make at the start: the multi-host hosts' cluster and
# JupyterLab missed their deadlines in a fresh clone's run); its summary and the coverage
# report end the output, whether the tests passed or not; .coverage stays for `.venv/bin/coverage html`. A
# process killed while it was creating its data file (the fault tests kill ranks) leaves it
# empty: dropped. 4 workers: the three groups that take minutes (Spark, the multi-host hosts,
# the browser) each hold one from the start, so 3 left the other tests waiting behind them.
WORKERS ?= 4
test: setup system-deps lint
	rm -f .coverage .coverage.*
	@mkdir -p build; \
	SPARK_LOCAL_IP=127.0.0.1 $(VENV)/bin/coverage run -m pytest -n $(WORKERS) --dist loadgroup \
	  -m "not ray" --file-durations; status=$$?; \
	$(VENV)/bin/coverage run -m pytest -m ray tests/ray || status=1; \
	find . -maxdepth 1 -name '.coverage.*' -empty -delete; \
	$(VENV)/bin/coverage combine --quiet && $(VENV)/bin/coverage report; \
	.ci/matrix > build/matrix.out 2>&1 || status=1; cat build/matrix.out; exit $$status

# The version matrix alone (docs/developing.md): a fast subset on Python 3.10 (ipykernel 6,
# IPython 8), 3.12 (ipywidgets 7) and 3.13; `make matrix LEGS=spark35` runs the Spark tests
# with pyspark 3.5 (not yet in `make test`: docs/developing.md says why).
LEGS ?=
matrix: system-deps
	.ci/matrix $(LEGS)

# Benchmarks (not part of the tests): every contender in the same run, medians and ratios.
bench: setup system-deps
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e '.[dev,torch,spark,connect,tf,jax,bench]'
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run.py
