#!/usr/bin/env sh
# Install Debian's headless-capable Chromium for tests/test_trace_browser.py, only if it is missing.
# Idempotent: does nothing when /usr/bin/chromium already exists. Needs root (or sudo) and apt.
set -eu
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: apt-get not found; install chromium by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
