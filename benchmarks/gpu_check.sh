#!/usr/bin/env bash
# Single-GPU check for a lent CUDA machine: prints nvidia-smi, then runs benchmarks/gpu_check.py (versions,
# NCCL world-size-1 collectives, bf16 training of the 1b preset: step time, tokens/s, peak memory, MFU)
# under `timeout` (GPU_CHECK_TIMEOUT, default 480 s; gpu_check.py itself aims for --max-seconds 420).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options]      e.g. --steps 30 --rows 8 --compile
#
# Results: benchmarks/results/gpu_check.json (or --out), written after every phase, so a run cut by the
# timeout still leaves what it measured. Exit status: that of gpu_check.py (124 on timeout).
#
# Which Python (a working CUDA torch is never reinstalled):
#   1. $PYTHON, if set.
#   2. .venv/bin/python, if .venv exists and its torch sees a GPU.
#   3. python3 on PATH, if its torch sees a GPU (e.g. a system-wide CUDA torch). The repo goes on PYTHONPATH.
#      If lightning_mm's dependencies (lightning, ...) are missing there and .venv does not exist, a .venv
#      with --system-site-packages is created and `pip install -e .` adds them, with torch constrained to
#      the installed version so pip can never swap the CUDA build (it fails instead; the check still runs,
#      and gpu_check.py records the missing dependency after the environment and NCCL phases).
#   4. No torch with CUDA anywhere and no .venv: scripts/setup.sh creates .venv (torch==2.13.0, then the
#      package).
#   5. Otherwise .venv/bin/python (or python3) as it is: gpu_check.py then says that CUDA is missing (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."

TIMEOUT=${GPU_CHECK_TIMEOUT:-480}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_deps() { "$1" -c 'import lightning_mm.models, lightning_mm.datamodules.regroup' >/dev/null 2>&1; }

py=""
if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
elif [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then
    py=.venv/bin/python
elif command -v python3 >/dev/null 2>&1 && has_cuda python3; then
    py=python3
    if ! has_deps python3 && [ ! -e .venv ]; then
        echo "== system python3 has a CUDA torch but not lightning_mm's dependencies: .venv (system site packages)"
        python3 -m venv --system-site-packages .venv
        constraints=$(mktemp)
        python3 -c 'import torch; print("torch==" + torch.__version__)' >"$constraints"
        if .venv/bin/python -m pip install --quiet -c "$constraints" -e .; then
            py=.venv/bin/python
        else
            echo "warning: pip install -e . failed (offline, or torch $(cat "$constraints") outside the package's range);" \
                 "continuing with python3 and PYTHONPATH" >&2
        fi
        rm -f "$constraints"
    fi
elif [ ! -e .venv ]; then
    echo "== no torch with CUDA found and no .venv: scripts/setup.sh"
    ./scripts/setup.sh
    py=.venv/bin/python
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi

echo "== python: $(command -v "$py" || echo "$py")"
"$py" -c 'import sys, torch; print(f"   {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")' || true

echo "== nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || echo "nvidia-smi failed (status $?)"
else
    echo "nvidia-smi not found"
fi

echo "== benchmarks/gpu_check.py $* (timeout ${TIMEOUT} s)"
rc=0
timeout --kill-after=20 "$TIMEOUT" "$py" benchmarks/gpu_check.py "$@" || rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_check.py stopped by the ${TIMEOUT} s timeout (status $rc); the JSON holds the phases that finished" >&2
fi
exit "$rc"
