# Two commands do all the set-up on a fresh machine (see README.md):
#   make quickstart   the main job: notebooks/01-quickstart.ipynb on 2 local ranks
#   make test         lint, types and the whole test suite (real kernels, Spark, a browser)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup quickstart test lint system-deps bench

setup: $(VENV)/.installed

# torch is pinned for development only (.ci/constraints.txt): any other version or range makes
# pip download a multi-GB CUDA build on this kind of machine. The tf and jax extras (the Keras
# tests and notebook) add about two minutes; they leave torch and numpy as they are.
$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c .ci/constraints.txt torch
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e '.[dev,torch,spark,tf,jax]'
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

test: setup system-deps lint
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m pytest

# Benchmarks (not part of the tests): every contender in the same run, medians and ratios.
bench: setup system-deps
	$(PY) -m pip install --quiet -c .ci/constraints.txt -e '.[dev,torch,spark,tf,jax,bench]'
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run.py
