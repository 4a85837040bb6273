PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench soak clean

# The venv is rebuilt when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

bench: $(STAMP)
	$(PY) bench/run.py $(ARGS)

# The whole suite RUNS times beside a CPU hog; per-test failure counts in bench/results/SOAK.md.
RUNS ?= 5
soak: $(STAMP)
	$(PY) bench/soak.py --runs $(RUNS) $(if $(ARGS),-- $(ARGS))

clean:
	rm -rf $(VENV) outputs
