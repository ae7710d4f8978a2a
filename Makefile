# Set-up and the two main jobs. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: demo test venv dev clean gpu-check compiled clean-compiled test-compiled

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.dev-installed

# A short side-by-side time-to-accuracy bench on the built-in digits data, one worker 4x slower: every
# step paced to 40 ms as if each worker had an accelerator; prints the time-to-target table first and
# draws the accuracy curves (runs/demo/accuracy.png).
demo: $(VENV)/.installed
	$(VENV)/bin/prague bench --algorithms allreduce,prague,adpsgd --scenarios straggler:3:4 --nproc 4 \
		--compute paced --compute-ms 40 --model mlp --data digits --budget epochs:8 --target-accuracy 0.95 \
		--eval-every-s 0.5 --out runs/demo

# The suite in two parts: two pytest workers (pytest-xdist) share everything but the tests marked `serial`, which
# time real work against a clock and then run alone. TEST_WORKERS=1 runs the first part in one worker.
TEST_WORKERS ?= 2
test: $(VENV)/.dev-installed
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial"
	$(PY) -m pytest -q -m serial

# On a machine with a CUDA device, with a Python whose PyTorch is a CUDA build (PYTHON, not the CPU venv):
# the CUDA tests, then 4 workers sharing the GPU over gloo with --compute real (benchmarks/gpu_check.py).
gpu-check:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py

# The simulator's hot path compiled to C with mypyc (setup.py, prague/native.py): the same decisions, 1.7x
# sooner. An extension shadows its source, so after editing a compiled module build again or clean; a stale
# build is refused at import with this fix.
compiled: $(VENV)/.dev-installed
	find src/prague -name '*.so' -delete
	PRAGUE_COMPILE=1 $(PY) setup.py -q build_ext --inplace

clean-compiled:
	rm -rf build/mypyc build/temp.* build/lib.*
	find src/prague -name '*.so' -delete
	rm -f src/prague/native_manifest.json

# The simulator's and the Group Generator's tests against the compiled build, and its records against the
# pure build's (tests/sim/test_native.py).
test-compiled: compiled
	$(PY) -m pytest -q tests/sim tests/groups

clean: clean-compiled
	rm -rf runs .pytest_cache
