#!/usr/bin/env bash
# System packages the tests use: the Debian `prometheus` package (prometheus + promtool)
# for tests/test_metrics.py, and `chromium` + `chromium-driver` for the headless-browser
# test of the dashboard (tests/test_dashboard.py). Idempotent. Never fails the run: where
# apt-get is missing or not permitted, the tests that need them skip and say why.
set -uo pipefail
PKGS=""
{ command -v prometheus && command -v promtool; } >/dev/null || PKGS="prometheus"
{ command -v chromium && command -v chromedriver; } >/dev/null || PKGS="$PKGS chromium chromium-driver"
PKGS="${PKGS# }"
if [ -z "$PKGS" ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "test-deps: apt-get not found; tests needing $PKGS will be skipped" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "test-deps: not root and no passwordless sudo; tests needing $PKGS will be skipped" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $PKGS; } >/dev/null 2>&1; then
  echo "test-deps: apt-get install $PKGS failed; the tests that need them will be skipped" >&2
fi
exit 0
