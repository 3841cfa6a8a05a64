# Every target works on a fresh machine: it creates the virtual environments and installs
# what it needs. MXNet 1.9.1 needs NumPy < 1.24 and TensorFlow 2.21 NumPy >= 1.26, so MXNet
# gets its own environment (.venv-mxnet); the core runs in both.
PYTHON  ?= python3
VENV    ?= .venv
VENV_MX ?= .venv-mxnet
PY      := $(VENV)/bin/python
PY_MX   := $(VENV_MX)/bin/python
NP      ?= 4
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

# the core on NumPy 1.23 plus the MXNet adapter
MX_TESTS := tests/test_mxnet_adapter.py tests/test_codec_base.py tests/test_codecs_common.py \
	tests/test_codecs_quant.py tests/test_codecs_sparse.py tests/test_powersgd.py \
	tests/test_config.py tests/test_engine.py tests/test_horovod_compat_mxnet.py \
	tests/test_horovod_compat.py

.PHONY: install venv-mxnet run run-tf run-mxnet test test-mxnet lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(PY_MX):
	$(PYTHON) -m venv $(VENV_MX)
	$(PY_MX) -m pip install -q --upgrade pip setuptools wheel

# torch==2.13.0 is the CPU wheel; a looser pin may download a multi-GB CUDA build.
install: $(PY)
	$(PY) -m pip install -q -e ".[test,torch,tensorflow]" "torch==2.13.0"

venv-mxnet: $(PY_MX)
	$(PY_MX) -m pip install -q -e ".[test,mxnet]"

# The main job: a CNN on scikit-learn's digits, NP ranks on this machine, onebit compression.
run: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" hipressrun -np $(NP) --config configs/digits-torch.yaml

run-tf: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" hipressrun -np $(NP) --config configs/digits-tf.yaml

run-mxnet: venv-mxnet
	PATH="$(CURDIR)/$(VENV_MX)/bin:$$PATH" hipressrun -np $(NP) --config configs/digits-mxnet.yaml

test: install venv-mxnet
	$(PY) -m ruff check .
	$(PY) -m pytest -q
	$(PY_MX) -m pytest -q $(MX_TESTS)

test-mxnet: venv-mxnet
	$(PY_MX) -m pytest -q $(MX_TESTS)

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(VENV_MX) build *.egg-info .pytest_cache .ruff_cache .hypothesis
