# Set-up and the two main jobs. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: demo test venv dev clean

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

# A short side-by-side comparison on the built-in digits data; prints the table.
demo: $(VENV)/.installed
	$(VENV)/bin/prague bench --algorithms allreduce,prague,adpsgd --scenarios homogeneous,paper:5 \
		--nproc 4 --model cnn --data digits --epochs 10 --out runs/demo

test: $(VENV)/.dev-installed
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

clean:
	rm -rf runs .pytest_cache
