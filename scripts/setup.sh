#!/usr/bin/env bash
# Creates .venv and installs lightning-mm with its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first, pinned: a bare `torch` requirement could pull a multi-GB CUDA build; 2.13.0 satisfies
# the package's own range, so the next install keeps it.
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
# dev: test tools; hf: the Hugging Face adapters and their tests (transformers 5.x, peft); docs: the MkDocs site.
.venv/bin/python -m pip install --quiet -e ".[dev,hf,docs]"
