# Two entry points, each doing all setup on a fresh machine:
#   make demo   -- the main job (OPSD training demo on embedded tiny models, CPU, OPSD_PROFILE=1)
#   make test   -- the test suite (newest tested transformers), then the model-facing tests on the
#                  oldest tested transformers (5.17, the GPU machine's version)
# torch is installed first so GPU users can keep their own CUDA build:
#   make test TORCH_SPEC="torch==2.11.0" PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu130"
PYTHON ?= python3
VENV ?= .venv
VENV_OLDEST ?= .venv-tx-oldest
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
TRANSFORMERS_OLDEST ?= transformers==5.17.0
PYTEST_ARGS ?=
COMPAT_TESTS = tests/test_rollout_correctness.py tests/test_rollout_behaviour.py tests/test_compat.py \
	tests/test_fast_decode.py tests/test_fast_prefill.py tests/test_routes.py tests/test_continuous.py \
	tests/test_rollout_lora.py

.PHONY: demo test test-newest test-oldest bench-postprocess clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(VENV)/bin/python -m pip install -q -e ".[test,clients]"
	touch $@

$(VENV_OLDEST)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(VENV_OLDEST)/bin/python -m pip install -q -e ".[test]" "$(TRANSFORMERS_OLDEST)"
	touch $@

demo: $(VENV)/.installed
	OPSD_PROFILE=1 OPSD_PROFILE_DIR=opsd_traces $(VENV)/bin/python scripts/train_opsd.py
	$(VENV)/bin/python scripts/summarize_trace.py $$(ls -dt opsd_traces/*/ | head -1)

test: test-newest test-oldest

test-newest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests

test-oldest: $(VENV_OLDEST)/.installed
	$(VENV_OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) $(COMPAT_TESTS)

bench-postprocess: $(VENV)/.installed
	$(VENV)/bin/python scripts/bench_postprocess.py

clean:
	rm -rf $(VENV) $(VENV_OLDEST) opsd_traces *.egg-info
