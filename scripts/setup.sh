#!/usr/bin/env bash
# Install vitlab into ./.venv: a wrapper for scripts/setup.py (the one setup script; see its --help).
#   bash scripts/setup.sh [--cpu] [--dev]   VITLAB_PYTHON picks the interpreter (default python3);
#   --cpu on Linux without an NVIDIA GPU
exec "${VITLAB_PYTHON:-python3}" "$(dirname "$0")/setup.py" "$@"
