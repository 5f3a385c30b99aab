#!/usr/bin/env bash
# Installs the pinned agent CLIs used by tests/clients/ from the npm registry into a cache
# directory OUTSIDE the repo (idempotent: a version already there is kept).
#   CODEX_VERSION / CLAUDE_CODE_VERSION override the pins; CLIENTS_DIR the location.
set -euo pipefail
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
CLIENTS_DIR="${CLIENTS_DIR:-$HOME/.cache/codebuddy2api/clients}"
if ! command -v npm >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm
fi
install_one() {  # <dir name> <package> <version>
    local dir="$CLIENTS_DIR/$1-$3"
    if [ -f "$dir/.installed" ]; then return; fi
    mkdir -p "$dir"
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "$2@$3"
    touch "$dir/.installed"
}
install_one codex @openai/codex "$CODEX_VERSION"
install_one claude-code @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION"
echo "$CLIENTS_DIR/codex-$CODEX_VERSION/node_modules/.bin/codex"
echo "$CLIENTS_DIR/claude-code-$CLAUDE_CODE_VERSION/node_modules/.bin/claude"
