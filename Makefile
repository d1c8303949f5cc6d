# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU install path. On a CUDA machine: make TORCH_SPEC=torch EXTRA=pycuda (see README).
TORCH_SPEC ?= torch==2.13.0
EXTRA ?=

.PHONY: venv proto test test-fast demo bench clean compose-test lmeval-venv

# lm-evaluation-harness in a venv of its own (its dependencies must not move the project's torch);
# `make test` builds it for tests/test_lm_eval.py (LMEVAL_VENV), docs/gateway.md shows the commands.
LMEVAL_VENV ?= .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt $(EXTRA)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	touch $@

venv: $(STAMP)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

test: proto $(LMEVAL_STAMP)
	LMEVAL_VENV=$(abspath $(LMEVAL_VENV)) $(BIN)/python -m pytest -q

# Builds the images and runs the compose stack for real (Docker; starts a daemon if none answers).
# Called by .ci/run after `make test`. See scripts/compose_test.py and docs/containers.md.
compose-test: proto
	$(BIN)/python scripts/compose_test.py

demo: proto
	$(BIN)/python scripts/demo.py

bench: proto
	$(BIN)/python bench/block_manager.py
	$(BIN)/python bench/kernels.py
	$(BIN)/python bench/e2e.py

lmeval-venv: $(LMEVAL_STAMP)

$(LMEVAL_STAMP):
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "transformers==5.23.0" \
		"lm-eval[api,hf]==0.4.13"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache build/kernels
