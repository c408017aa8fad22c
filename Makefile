# Fresh-machine entry points. Each target sets up its own virtual environment:
# torch is installed first, pinned (a CPU build on this machine), then lmrl with its extras
# under a constraints file that keeps that pin.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: venv test lint demo clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,ray]'
	touch $@

venv: $(VENV)/.installed

test: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

demo: venv
	HF_HUB_OFFLINE=1 $(VENV)/bin/lmrl demo

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
