# Each target creates .venv and installs what it needs, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(CURDIR)/.venv/prefect-home
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test lint docs bench clean up

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The demo needs the package alone, not the test extras: a minute, not ten, on a fresh clone.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/rollflow demo --output demo-out

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) docs/check_architecture.py
	$(PY) docs/gen_nemo_gym.py --check
	rm -rf $(VENV)/lint-tree && mkdir -p $(VENV)/lint-tree/rollflow
	cp -R rollflow/. flows tasks settings infra $(VENV)/lint-tree/rollflow/
	cd $(VENV)/lint-tree && PYTHONPATH=. ../bin/lint-imports --no-cache --config $(CURDIR)/pyproject.toml

# The docs site: the reference pages generated from the code, then MkDocs with warnings as errors.
docs: $(STAMP)
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

# Tests that check no rate, duration or deadline run three at a time; the rest then run alone.
test: lint docs
	$(PY) -m pytest -q -ra -m concurrent -n 3 --dist loadfile --durations=10 --junitxml=$(VENV)/junit-side.xml; side=$$?; \
	$(PY) -m pytest -q -ra -m "not concurrent" --durations=15 --junitxml=$(VENV)/junit-alone.xml; alone=$$?; \
	test $$side -eq 0 && test $$alone -eq 0

bench: $(STAMP)
	$(PY) bench/client_ceiling.py
	$(PY) bench/collectors.py
	$(PY) bench/efficiency.py
	$(PY) bench/memory.py
	$(PY) bench/tuning.py
	$(PY) bench/replicas.py
	$(PY) bench/fault_suite.py
	$(PY) bench/million.py
	$(PY) bench/startup.py
	$(PY) bench/end_to_end.py
	$(PY) bench/verify.py
	$(PY) bench/scale_out.py
	$(PY) bench/split_floor.py
	$(PY) bench/reverify.py
	$(PY) bench/settle.py

clean:
	rm -rf $(VENV) demo-out site

up: $(STAMP)
	PY=$(PY) infra/local-up.sh
