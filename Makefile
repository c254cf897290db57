# ddp-lab: every command a student, an instructor or a TA needs.
#   make lab3   run lab 3's distributed workload (all GPUs, or 2 CPU processes with gloo)
#   make test   the whole test suite (installs .venv first when needed)
# `make help` lists the rest.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# One thread per process: N processes share the cores. Gloo restarts need the second one.
export OMP_NUM_THREADS ?= 1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1
# nbgrader calls helper programs (alembic) by name: the venv's bin must come first.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.DEFAULT_GOAL := help
.PHONY: help install test test-fast lint format lab3 lab5 lab6 lab8 bench lab time-labs release student-kit autograde feedback grades sample-class clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 14

# The virtual environment is rebuilt only when the pins change (quick no-op otherwise).
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "ddp-lab needs Python >= 3.11; set PYTHON=python3.11"' \
	  || { echo "make: ddp-lab needs Python >= 3.11 (found $$($(PYTHON) --version 2>&1)); run: make PYTHON=python3.11 ..." >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing the pinned course environment into $(VENV) (first time: a few minutes)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[course,dev]'
	@touch $(STAMP)

install: $(STAMP)  ## build .venv from the pins (quick when nothing changed)

# Two tests at a time (pytest-xdist): most tests wait on process start-ups and torchrun jobs
# that leave a core idle. A lab's tests share a worker (tests/conftest.py). TEST_WORKERS=0 (or
# `.venv/bin/python -m pytest ...`) runs them one by one in one process.
TEST_WORKERS ?= 2
PYTEST_ARGS := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: $(STAMP)  ## the whole test suite
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the quick subset (no torchrun sweeps, no notebooks)
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow"

lint: $(STAMP)  ## ruff lint and format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)  ## ruff format and autofix
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# In a SLURM allocation of 2+ nodes it runs across them (srun, one torchrun agent per node)
# into results/lab3-slurm-<jobid>/; cluster/lab3.sbatch submits exactly this.
lab3: $(STAMP)  ## lab 3's DDP workload on every GPU (or 2 CPU processes) into results/lab3/
	$(PY) -m ddp_lab.workloads.lab3 $(LAB3_ARGS)

lab5: $(STAMP)  ## lab 5: fp32 vs bf16 vs fp16+scaler, accumulation 1 vs 4, into results/lab5/
	$(PY) -m ddp_lab.workloads.lab5 $(LAB5_ARGS)

lab6: $(STAMP)  ## lab 6: a clean run vs one with a fault under --max-restarts=3, into results/lab6/
	$(PY) -m ddp_lab.workloads.lab6 $(LAB6_ARGS)

lab8: $(STAMP)  ## lab 8: a profiled DDP run, every rank's trace and a timeline, into results/lab8/
	$(PY) -m ddp_lab.workloads.lab8 $(LAB8_ARGS)

bench: $(STAMP)  ## trainer vs plain PyTorch DDP (interleaved pairs), comm share, ring vs gloo (results/bench/)
	$(PY) -m ddp_lab.bench $(BENCH_ARGS)

# Jupyter refuses to start as root unless told; in a container (the usual case on clusters)
# you are root, so the target says so and passes --allow-root.
lab: $(STAMP)  ## JupyterLab (with nbgrader's extensions) on the course
	@if [ "$$(id -u)" = 0 ]; then echo "make lab: you are root (as in most containers): starting JupyterLab with --allow-root"; fi
	$(VENV)/bin/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(JUPYTER_ARGS)

time-labs: $(STAMP)  ## run every solution notebook top to bottom in a scratch copy, timed
	$(PY) -m ddp_lab.grading.smoke $(TIME_LABS_ARGS)

# --- instructors: nbgrader (solutions/ is the source, labs/ the release, grading/ the rest)
LABS := $(notdir $(wildcard solutions/lab*))

release: $(STAMP)  ## regenerate labs/ from solutions/ (commit the result)
	@for lab in $(LABS); do \
	  $(VENV)/bin/nbgrader generate_assignment $$lab --force --create --log-level=WARN || exit 1; \
	  echo "released labs/$$lab"; \
	done

student-kit: $(STAMP)  ## what students get, without any answer: dist/ddp-lab-student-kit(.tar.gz)
	$(PY) -m ddp_lab.grading.kit --out dist

autograde: $(STAMP)  ## grade grading/submitted/<student>/<lab>/ (sandboxed, time-limited)
	$(PY) -m ddp_lab.grading.autograde $(AUTOGRADE_ARGS)

feedback: $(STAMP)  ## HTML feedback for every autograded submission, in grading/feedback/
	@for lab in $(LABS); do \
	  $(VENV)/bin/nbgrader generate_feedback $$lab --force --log-level=WARN || exit 1; \
	done

grades: $(STAMP)  ## export the gradebook to grading/grades.csv
	$(VENV)/bin/nbgrader export --to grading/grades.csv --log-level=WARN
	@echo "wrote grading/grades.csv"

sample-class: $(STAMP)  ## put a demo class (perfect, blank, mistake, hang, cheat) into grading/submitted
	$(PY) -m ddp_lab.grading.sample_class grading/submitted

clean:  ## remove run outputs (keeps .venv)
	rm -rf runs results dist .pytest_cache .ruff_cache
