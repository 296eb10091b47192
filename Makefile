# The two commands of the README: `make demo` (main job) and `make test` (tests).
# Both run scripts/setup.sh first, so they work on a fresh machine; the tests also install
# vLLM's CPU build (its own virtualenv, outside the clone) for the vLLM router-mode tests.
.PHONY: setup demo test bench proto

setup:
	@./scripts/setup.sh

demo: setup
	.venv/bin/kvmesh demo

test:
	@./scripts/setup.sh --vllm-peer
	.venv/bin/python -m pytest -q -ra

bench: setup
	.venv/bin/python -m kvmesh.bench.micro --json

proto: setup
	.venv/bin/python -m kvmesh.proto.generate
