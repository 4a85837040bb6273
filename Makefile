PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The package and what training needs (make train); then the developers' tools too (the rest).
BASE := $(VENV)/.installed
STAMP := $(VENV)/.installed-dev

.PHONY: train test test-unit test-fast lint format bench soak look docs clean

# Python caches the bytecode of what it imports, on first use: the install does not compile every
# file of torch and the rest (pip does that one file at a time: half of a 150 s install here) but
# imports what a run imports once. An environment that sets PYTHONDONTWRITEBYTECODE would
# otherwise recompile torch at every start.
unexport PYTHONDONTWRITEBYTECODE

# The venv is rebuilt when the project's dependencies change. A user's `make train` installs the
# package alone; the developers' extra comes with the first target that uses it. pip -qq: errors
# only (setuptools' notes on an editable install read as a broken one before the first line of training).
$(BASE): pyproject.toml $(wildcard setup.py)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq --no-compile -e .
	$(PY) -c 'import hydra_ddp.launch.command, hydra_ddp.training.worker, torch._dynamo, tensorboard.backend.event_processing.event_accumulator'
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -qq --no-compile -e '.[dev]'
	touch $(STAMP)

train: $(BASE)
	$(PY) train.py $(ARGS)

# Everything: both layers (pyproject.toml leaves out the `look` marker). The unit layer runs in
# UNIT_WORKERS pytest-xdist processes (its tests are in-process and CPU-bound: two keep it under
# a minute on the 2-core machine, bench/results/UNIT_LAYER.md); the end-to-end layer one test at
# a time, since its ranks already keep the cores busy (two workers there gained nothing:
# bench/results/CI_RUNS.md). A failing unit layer does not stop the end-to-end one: the run
# reports every failure, as one pytest did, and fails if either layer failed.
# Each layer's per-test seconds and launches go to DURATIONS (tests/durations.py), and the 25
# slowest of the whole run are printed at its end, with its totals.
UNIT_WORKERS ?= 2
DURATIONS ?= .test-results
test: $(STAMP)
	rm -rf $(DURATIONS); export HDDP_DURATIONS_DIR=$(DURATIONS); \
	$(PY) -m pytest -n $(UNIT_WORKERS) tests/unit $(ARGS); unit=$$?; \
	$(PY) -m pytest tests/e2e $(ARGS); e2e=$$?; \
	$(PY) tests/durations.py $(DURATIONS); [ $$unit = 0 ] && [ $$e2e = 0 ]

# The unit layer alone: every test that runs in the test's own process (no subprocess, no server,
# no cluster), in under a minute.
test-unit: $(STAMP)
	$(PY) -m pytest -q -n $(UNIT_WORKERS) tests/unit $(ARGS)

# The inner loop: the unit layer and a named handful of end-to-end runs (the default run, an outside
# torchrun launch, the forkserver's start-up, the first failure named, exact evaluation on real gloo
# ranks, the CI skip plugin, train.py --check): a few minutes.
FAST_E2E := tests/e2e/test_train_e2e.py::test_default_run_leaves_one_complete_run_directory \
	tests/e2e/test_gpu_ready.py::test_sync_batchnorm_auto_under_an_outside_torchrun_trains \
	tests/e2e/test_gpu_ready.py::test_the_first_failure_is_named_when_the_other_ranks_were_aborted \
	tests/e2e/test_startup.py::test_forkserver_workers_inherit_frozen_imports_with_the_collector_on \
	tests/e2e/test_training.py::test_evaluation_is_exact_and_train_losses_are_global \
	tests/e2e/test_ci.py::test_a_skip_fails_under_ci_and_stays_a_skip_outside \
	tests/e2e/test_check.py::test_check_says_what_would_run_and_launches_nothing
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -n $(UNIT_WORKERS) tests/unit $(ARGS)
	$(PY) -m pytest -q $(FAST_E2E) $(ARGS)

# The linter and the formatter (pyproject.toml's [tool.ruff]): `make format` rewrites, this only checks.
LINTED := src tests bench conf train.py eval.py setup.py
lint: $(STAMP)
	$(VENV)/bin/ruff check .  # every Python file of the repository
	$(VENV)/bin/ruff format --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

# TensorBoard and the MLflow UI served against real runs and looked at in headless Chromium
# (Debian's: apt-get install chromium), the screenshots into docs/img (the loggers' page shows
# them). Not in `make test`: Chromium's install and renders cost more than CI's time allows.
look: $(STAMP)
	LOOK_DIR=docs/img $(PY) -m pytest -q -m look tests/e2e/test_ui.py $(ARGS)

# The manual as a site (mkdocs.yml), strictly: a broken link, a missing page or a file outside the
# nav fails. Its home page is README.md with the links made the site's.
docs: $(STAMP)
	sed -e 's#](docs/#](#g' README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	$(PY) bench/run.py $(ARGS)

# The whole suite RUNS times beside a CPU hog; per-test failure counts in bench/results/SOAK.md.
RUNS ?= 5
soak: $(STAMP)
	$(PY) bench/soak.py --runs $(RUNS) $(if $(ARGS),-- $(ARGS))

clean:
	rm -rf $(VENV) outputs site docs/index.md
