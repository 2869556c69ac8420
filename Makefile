# fedsaddle: `make run` runs the built-in federation on loopback, `make test` checks everything.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# mypy cannot follow setuptools' editable-install import hook, so it reads the
# package through a tree of links named as installed (fedsaddle.server -> server/).
TYPECHECK := .typecheck

.PHONY: all install run test lint typecheck unit proto bench certs clean compose-test

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,data,plot]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/fedsaddle local --quiet-clients

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(TYPECHECK)/fedsaddle: $(wildcard fedsaddle/*.py)
	mkdir -p $@
	for f in fedsaddle/*.py fedsaddle/py.typed; do ln -sf ../../$$f $@/$$(basename $$f); done
	for d in common client server experiments proto; do ln -sfn ../../$$d $@/$$d; done

typecheck: $(STAMP) $(TYPECHECK)/fedsaddle
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml -p fedsaddle

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/python bench/round_latency.py
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/paper_sweep.py
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/abuse.py
	$(BIN)/python bench/chunk_flood.py

# The multi-container federation for real: podman builds the images, docker-compose runs
# docker-compose.yml through podman's Docker API, the result must equal `fedsaddle simulate`.
compose-test: $(STAMP)
	bash scripts/compose-test.sh

# A development CA, a coordinator certificate and client certificates in certs/.
certs:
	bash scripts/dev-certs.sh certs site-a site-b

clean:
	rm -rf $(VENV) $(TYPECHECK) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
