# Everyday commands.  `make setup` is idempotent: the first run installs Open MPI, the pinned
# framework stack and builds Horovod (~10 min on 2 cores); later runs reuse the cached build.
# .ci/setup's RINGTRAIN_VENV, when set, is the venv every target uses.
VENV ?= $(or $(RINGTRAIN_VENV),.venv)
PY := $(VENV)/bin/python
NP ?= 4
ARGS ?=

.PHONY: setup setup-ray run run-tf test lint bench bench-quick bench-cluster wheel

setup:
	bash .ci/setup

# The patched Horovod as a wheel in dist/ for your own scripts (docs/healed-horovod.md):
# horovod-0.28.1+ringtrain.<series hash>-...whl, the one setup built and cached (never built twice);
# it prints the Python, torch, TensorFlow, MPI and compiler the wheel is bound to.
wheel: setup
	bash .ci/wheel

run: setup
	$(VENV)/bin/horovodrun -np $(NP) $(PY) -m launch.torch_mnist $(ARGS)

run-tf: setup
	$(VENV)/bin/horovodrun -np $(NP) $(PY) -m launch.tf_mnist $(ARGS)

# The suite also runs the Ray launcher's tests (tests/test_ray*.py), so test installs the ray
# extra; setup and run stay without it.
setup-ray:
	RINGTRAIN_RAY=1 bash .ci/setup

test: setup-ray
	$(PY) -m ruff check .
	$(PY) -m pytest

lint:
	$(PY) -m ruff check .

# Benchmarks (bench/README.md): install the bench extra (matplotlib, py-spy) pinned by
# constraints.txt, then run the suite; results in bench/results/, report in BENCHMARKS.md.
bench-deps: setup
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt --no-build-isolation -e '.[bench]'

bench: bench-deps
	$(PY) -m bench $(ARGS)

bench-quick: bench-deps
	$(PY) -m bench --quick $(ARGS)

# The emulated cluster (4 network-namespace hosts on shaped links: collectives, bandwidth-bound
# training, cost model, projection) and Horovod's small-message floor on one host: sections 6-7
# of BENCHMARKS.md.  Needs root; on an idle 2-core machine (2026-11-28) the cluster part took
# 31 min and the floor part 20 min; ARGS=--quick for a short version that prints no comparisons.
bench-cluster: bench-deps
	$(PY) -m bench --only cluster,floor $(ARGS)
