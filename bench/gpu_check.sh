#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): under 10 minutes on one GPU; GPU-only parts skipped on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m bench.gpu_check "$@"
