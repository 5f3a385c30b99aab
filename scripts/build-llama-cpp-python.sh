#!/usr/bin/env bash
# Installs llama-cpp-python's OpenAI-compatible server for `make test-real-lcp` — a second real
# upstream with quirks of its own (docs/upstreams.md) — into its own venv in a cache directory
# OUTSIDE the repo (default ~/.cache/codebuddy2api/llama-cpp-python, override with
# CODEBUDDY2API_LCP_DIR). The package is a PyPI sdist that compiles llama.cpp with cmake; only
# the shared libraries it loads are built (no tests, examples, tools, multimodal library).
# The model is the SmolLM2-135M GGUF that scripts/fetch-smollm2.sh fetches for llama-server.
# Idempotent: the build is skipped when the venv's stamp names this version. ~7+ min on 2 cores.
# Prints nothing but the paths at the end (python=..., model=...).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
LCP_DIR="${CODEBUDDY2API_LCP_DIR:-$HOME/.cache/codebuddy2api/llama-cpp-python}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${LLAMA_BUILD_JOBS:-2}"
PYTHON="${PYTHON:-python3}"

VENV="$LCP_DIR/venv"
STAMP="$VENV/.built-llama-cpp-python-$LCP_VERSION"

mkdir -p "$LCP_DIR/downloads"

if [ ! -f "$STAMP" ]; then
    need_apt=()
    command -v cmake >/dev/null || need_apt+=(cmake)
    command -v ninja >/dev/null || need_apt+=(ninja-build)
    command -v g++ >/dev/null || need_apt+=(g++)
    if [ ${#need_apt[@]} -gt 0 ]; then
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need_apt[@]}"
    fi
    sdist="$LCP_DIR/downloads/llama_cpp_python-$LCP_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LCP_VERSION" -d "$LCP_DIR/downloads"
    fi
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # GGML_NATIVE=OFF: a portable AVX2 build (no -march=native, no AMX, whose weight repacking
    # segfaults at load on CPUs that report it); LLAVA_BUILD=OFF: the multimodal library is
    # loaded only by vision chat handlers, never by a text model.
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF \
-DCMAKE_BUILD_TYPE=Release" \
    CMAKE_GENERATOR=Ninja CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$VENV/bin/python" -m pip install -q "${sdist}[server]"
    "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app; assert llama_cpp.__version__ == '$LCP_VERSION', llama_cpp.__version__"
    touch "$STAMP"
fi

MODEL="$(PYTHON="$PYTHON" bash "$HERE/fetch-smollm2.sh")"

echo "python=$VENV/bin/python"
echo "model=$MODEL"
