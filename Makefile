# Every target works on a fresh machine: it creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: install run test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

# torch==2.13.0 is the CPU wheel; a looser pin may download a multi-GB CUDA build.
install: $(PY)
	$(PY) -m pip install -q -e ".[test,torch]" "torch==2.13.0"

# The main job: a CNN on scikit-learn's digits, NP ranks on this machine, onebit compression.
run: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" hipressrun -np $(NP) --config configs/digits-torch.yaml

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
