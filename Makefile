PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-fast lint format bench soak look docs clean

# Python caches the bytecode of what it imports, on first use: the install does not compile every
# file of torch and the rest (pip does that one file at a time: half of a 150 s install here) but
# imports what a run imports once. An environment that sets PYTHONDONTWRITEBYTECODE would
# otherwise recompile torch at every start.
unexport PYTHONDONTWRITEBYTECODE

# The venv is rebuilt when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	$(PY) -c 'import hydra_ddp.launch.command, hydra_ddp.training.worker, torch._dynamo, tensorboard.backend.event_processing.event_accumulator'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# The inner loop: the pure-logic tests (config resolution and checks, the loop's parts, timing, the
# package's shape) and a few end-to-end runs (outside torchrun, the start-up): a few minutes.
FAST_TESTS := tests/test_architecture.py tests/test_checks.py tests/test_loop_parts.py tests/test_timing.py \
	tests/test_config.py tests/test_data.py tests/test_models.py tests/test_training.py tests/test_gpu_ready.py \
	tests/test_startup.py tests/test_ci.py tests/test_hangs.py tests/test_flops.py
test-fast: $(STAMP)
	$(PY) -m pytest -q $(FAST_TESTS) $(ARGS)

# The linter and the formatter (pyproject.toml's [tool.ruff]): `make format` rewrites, this only checks.
LINTED := src tests bench train.py eval.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

# TensorBoard and the MLflow UI served against real runs and looked at in headless Chromium
# (Debian's: apt-get install chromium), the screenshots into docs/img (the loggers' page shows
# them). Not in `make test`: Chromium's install and renders cost more than CI's time allows.
look: $(STAMP)
	LOOK_DIR=docs/img $(PY) -m pytest -q -m look tests/test_ui.py $(ARGS)

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
