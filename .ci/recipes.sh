#!/usr/bin/env bash
# Installs the client libraries docs/clients.md's recipes use, outside the repository:
# a Python venv with LangChain's OpenAI chat model, and node_modules with the OpenAI and
# Anthropic Node SDKs and the Vercel AI SDK. tests/test_recipes.py runs the recipes
# with them (`make test-recipes`). Re-running is cheap: both steps are skipped when done.
set -euo pipefail
DIR="${CODEBUDDY2API_RECIPES_DIR:-$HOME/.cache/codebuddy2api/recipes}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DIR"
if [ ! -x "$DIR/venv/bin/python" ] || ! "$DIR/venv/bin/python" -c 'import langchain_openai' 2>/dev/null; then
    "$PYTHON" -m venv "$DIR/venv"
    "$DIR/venv/bin/pip" install -q --disable-pip-version-check "langchain-openai==1.7.4"
fi
if [ ! -d "$DIR/node/node_modules/@ai-sdk/openai" ]; then
    command -v npm >/dev/null || { echo "recipes.sh: npm is required (apt-get install nodejs npm)" >&2; exit 1; }
    mkdir -p "$DIR/node"
    npm install --prefix "$DIR/node" --no-audit --no-fund --silent openai@6.49.0 @anthropic-ai/sdk@1.14.0 ai@6.0.326 @ai-sdk/openai@3.0.141
fi
echo "$DIR"
