#!/usr/bin/env bash
# Installs everything the tests need into ./.venv (CPU torch wheel first, so no CUDA build is pulled),
# installs Debian's chromium for the browser test when missing, lints, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# the README's CPU command: torch from its CPU index (PyPI's Linux torch is the multi-GB CUDA build); one retry:
# where that index is unreachable, pip takes a local copy of the same wheel (find-links) without minutes of retries
python -m pip install -q --retries 1 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
python -m pip install -q -r requirements-dev.txt
# Hugging Face's `kernels` wheel (transformers requires it), also kept as a file: tests/test_install.py installs the
# project beside it in a folder of its own
python -m pip download -q --no-deps -d .venv/wheels kernels

if [ ! -x /usr/bin/chromium ]; then
    echo "installing Debian's chromium for the browser test"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

ruff check .
python -m pytest -q --timeout=900 "$@"
