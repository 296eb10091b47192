# The two commands of the README: `make demo` (main job) and `make test` (tests).
# Both run scripts/setup.sh first, so they work on a fresh machine.
.PHONY: setup demo test bench proto

setup:
	@./scripts/setup.sh

demo: setup
	.venv/bin/kvmesh demo

test: setup
	.venv/bin/python -m pytest -q -ra

bench: setup
	.venv/bin/python -m kvmesh.bench.micro --json

proto: setup
	.venv/bin/python -m kvmesh.proto.generate
