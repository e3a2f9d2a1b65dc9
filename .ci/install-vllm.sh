#!/usr/bin/env bash
# Create (or bring up to date) .venv-vllm: vLLM 0.33.0 on the CPU build of torch 2.13.0, for the
# `vllm`-marked tests. Idempotent: a second run only re-installs kvpool itself.
#
# vLLM's wheel is installed WITHOUT its dependency tree (which pins torch 2.14 and CUDA
# packages); its scheduler, KV-cache manager and connector base are pure Python and run on CPU.
# See ../shared/VLLM_CPU_TESTS.md (the recipe) and tests/client/vllm-constraints.txt (the pins).
#
#   .ci/install-vllm.sh && .venv-vllm/bin/python -m pytest -m vllm tests/integration
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PINS=tests/client/vllm-constraints.txt
PY=$VENV/bin/python
PIP="$VENV/bin/pip --disable-pip-version-check -q"

[ -x "$PY" ] || python3 -m venv "$VENV"
if ! "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.33.0')" >/dev/null 2>&1; then
    $PIP install torch==2.13.0
    $PIP install --no-deps -c "$PINS" vllm xgrammar apache-tvm-ffi
    # Everything else exactly as frozen; pip's resolver complaint about vllm's own
    # requirements (torch==2.14.0, flashinfer, ...) is expected and harmless here.
    grep -v -E '^(#|vllm==|xgrammar==|apache-tvm-ffi==)' "$PINS" > "$VENV/pins.txt"
    $PIP install -c "$PINS" -r "$VENV/pins.txt"
fi
$PIP install -e '.[test]'
"$PY" -c "import vllm, kvpool.client.vllm; print('vLLM', vllm.__version__, 'ready in $VENV')" \
    2>&1 | tail -1
