# The README's two commands: `make demo` (the main job) and `make test`.
# Both do all set-up on a fresh machine: a .venv with a CPU torch and this package.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# glibc's heap checks for pytest and every process a test starts (tests/support/heap.py):
# a heap error aborts with glibc's message and fails the test that saw it; MALLOC_PERTURB_
# fills memory on malloc and free. Not MALLOC_CHECK_: on glibc >= 2.34 it needs
# libc_malloc_debug.so preloaded, whose checking malloc is not fork-safe (a child forked
# while another thread holds its lock hangs: tests/unit/test_heap_checks.py).
HEAP_CHECKS ?= MALLOC_PERTURB_=165
# pytest workers (pytest-xdist): the suite waits on servers, schedulers and launches much of
# the time, so two workers keep a 2-core machine busy (a fresh-clone run: 63 % busy with
# two; three were slower, the CPUs full while the slow tests ran). 0: in this one process.
# --dist loadscope: units drawn by tests/conftest.py from what tests share (a module with a
# scoped fixture, or one cluster, stays on one worker; other tests go one by one).
PYTEST_WORKERS ?= 2

.PHONY: demo test lint typecheck bench clean setup

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned torch first: a looser spec could pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m reshard_client.demo

test: $(VENV)/.installed
	$(PY) -m ruff check reshard_svc server client tests bench
	$(HEAP_CHECKS) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(VENV)/.installed
	$(PY) -m mypy

bench: $(VENV)/.installed
	$(PY) bench/plan.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
