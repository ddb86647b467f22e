#!/usr/bin/env bash
# System packages the tests use: the Debian `prometheus` package (prometheus + promtool)
# for tests/test_metrics.py. Idempotent. Never fails the run: where apt-get is missing or
# not permitted, the tests that need Prometheus skip and say why.
set -uo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "test-deps: apt-get not found; Prometheus tests will be skipped" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "test-deps: not root and no passwordless sudo; Prometheus tests will be skipped" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus; } >/dev/null 2>&1; then
  echo "test-deps: apt-get install prometheus failed; Prometheus tests will be skipped" >&2
fi
exit 0
