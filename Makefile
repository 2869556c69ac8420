# fedsaddle: `make run` runs the built-in federation on loopback, `make test` checks everything.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH_STAMP := $(VENV)/.torch-stamp
# Why a tree of links must stay: the folders the users asked for (server/, client/, common/, proto/) are
# installed under one import name by setuptools' package-dir mapping (fedsaddle.server -> server/). At run
# time an editable install resolves that mapping with an import hook (a meta-path finder), but mypy never
# runs import hooks: it derives a module's name from the directories above its file, and it has no option
# that maps a module prefix to a folder (mypy_path, explicit_package_bases and namespace packages all
# name server/pool.py `server.pool`, not `fedsaddle.server.pool`). The alternatives are worse: renaming the
# folders undoes the layout the users asked for, and setuptools' editable_mode=strict links each file at
# install time, so every new module would need a reinstall. So mypy reads .typecheck/fedsaddle, whose
# links give each folder its installed name. Tools that read the source themselves follow the mapping from
# pyproject.toml directly (tests/test_import_graph.py does).
TYPECHECK := .typecheck

.PHONY: all install run test lint typecheck docs unit proto bench certs clean compose-test kube-test

all: test

# The ray extra (about 285 MB, 12 s to install here) is in so that the two-node Ray test runs (27 to 60 s here, by load);
# the trackers' extras (about 75 MB, mostly mlflow-skinny's; dev adds TensorBoard's reader, about 35 MB) so that
# tests/test_trackers.py runs.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,data,plot,docs,privacy,ray,tensorboard,mlflow,monitor]'
	touch $(STAMP)

# The torch extra, for the PyTorch problems' tests and their type checks: the registry serves PyTorch's CUDA
# build, about 5 GB installed and a few minutes to install, so `make run` (the core, which never imports torch)
# does without it; `make install`, `make test` and the targets that read the PyTorch modules install it.
$(TORCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[torch]'
	touch $(TORCH_STAMP)

install: $(TORCH_STAMP)

run: $(STAMP)
	$(BIN)/fedsaddle local --quiet-clients

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(TYPECHECK)/fedsaddle: $(wildcard fedsaddle/*.py)
	rm -rf $@
	mkdir -p $@
	for f in fedsaddle/*.py fedsaddle/py.typed; do ln -sf ../../$$f $@/$$(basename $$f); done
	ln -sfn ../../fedsaddle/cli $@/cli
	for d in common client server experiments proto; do ln -sfn ../../$$d $@/$$d; done

typecheck: $(TORCH_STAMP) $(TYPECHECK)/fedsaddle
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml -p fedsaddle

# Most tests wait on processes and sockets, so one worker per core (at most four) roughly halves the wall
# time on two cores. Each test still starts and stops its own processes, on ports and namespaces of its own.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')

unit: $(TORCH_STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal

# The documentation site (mkdocs.yml, docs/), with warnings as errors: a broken link fails the build.
docs: $(TORCH_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# About 11 minutes from a fresh clone on a 2-core machine (pytest about 9); tests/README.md has the measured figures.
test: lint typecheck docs unit

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/python bench/round_latency.py
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/memory.py --secure
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/paper_sweep.py
	$(BIN)/python bench/sweep_cost.py
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/abuse.py
	$(BIN)/python bench/chunk_flood.py

# The multi-container federation for real: podman builds the images, docker-compose runs
# docker-compose.yml through podman's Docker API, the result must equal `fedsaddle simulate`.
compose-test: $(STAMP)
	bash scripts/compose-test.sh

# The manifests of `fedsaddle deploy kubernetes` played with `podman kube play` (the compose test's images,
# rebuilt from cache), a client pod deleted and played again mid-run, the result equal to `fedsaddle simulate`.
kube-test: $(STAMP)
	bash scripts/kube-test.sh

# A development CA, a coordinator certificate and client certificates in certs/.
certs:
	bash scripts/dev-certs.sh certs site-a site-b

clean:
	rm -rf $(VENV) $(TYPECHECK) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
