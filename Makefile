# The two commands: `make run` serves the embedded model (OpenAI-compatible API); `make test` runs the tests.
.PHONY: setup run test test-quick dashboard-png

setup:
	@./scripts/setup.sh

run: setup
	.venv/bin/slimkv serve    # prints where to point a client: base_url http://127.0.0.1:8000/v1

test: setup
	@./scripts/test-deps.sh
	.venv/bin/python -m pytest -q --durations=25    # the slowest tests, to keep the suite under 20 min

test-quick: setup
	.venv/bin/python -m pytest -q -m "not slow"

# Regenerate docs/dashboard.png (tests never write into the checkout).
dashboard-png: setup
	SLIMKV_DASHBOARD_PNG=$(CURDIR)/docs/dashboard.png .venv/bin/python -m pytest -q \
		tests/test_dashboard.py -k real_browser
