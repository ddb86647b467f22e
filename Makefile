# The two commands: `make run` starts slimkv on the embedded model; `make test` runs the tests.
.PHONY: setup run test test-quick

setup:
	@./scripts/setup.sh

run: setup
	.venv/bin/slimkv generate "What is the capital of France?" --chat --kv-dtype int8

test: setup
	.venv/bin/python -m pytest -q

test-quick: setup
	.venv/bin/python -m pytest -q -m "not slow"
