#!/bin/sh
# Install the LiteLLM proxy into bench/.peer-venv (never into the project venv).
# On failure: say so clearly, leave bench/results/peer-install-failed.txt (the doc notes it), exit 1.
set -u
VENV=bench/.peer-venv
PY=${PYTHON:-python3}
mkdir -p bench/results
if [ -x "$VENV/bin/litellm" ]; then
    rm -f bench/results/peer-install-failed.txt
    exit 0
fi
echo "bench-peer: installing litellm[proxy] into $VENV (a few minutes, once)"
if { "$PY" -m venv "$VENV" && "$VENV/bin/pip" install -q 'litellm[proxy]'; } > bench/results/peer-install.log 2>&1 \
        && [ -x "$VENV/bin/litellm" ]; then
    rm -f bench/results/peer-install-failed.txt
    exit 0
fi
{ date -u +%Y-%m-%dT%H:%M:%SZ; tail -n 20 bench/results/peer-install.log 2>/dev/null; } > bench/results/peer-install-failed.txt
echo "bench-peer: FAILED to install litellm[proxy] into $VENV; no LiteLLM figures this time." >&2
echo "bench-peer: see bench/results/peer-install.log; docs/performance.md notes the failure." >&2
.venv/bin/python bench/report.py >/dev/null 2>&1 || true
exit 1
