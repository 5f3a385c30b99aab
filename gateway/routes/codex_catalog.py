"""The Codex CLI's model catalog shape, served on ``GET /v1/models?client_version=...``.

Codex does not read the OpenAI model list for a model's metadata: it looks the model up
in its own catalog (``codex-rs`` ``ModelsResponse { models: Vec<ModelInfo> }``), the one
bundled in the binary merged with what the provider's ``GET {base_url}/models?
client_version=<version>`` returns. It asks the provider only when the provider
authenticates by command (``auth = { command = ... }``; an ``env_key`` provider never
asks), and a model it finds nowhere runs on fallback metadata (a guessed 272,000-token
window) with the warning "Model metadata for `<model>` not found". The
``client_version`` query parameter is how Codex's ``ModelsClient`` marks that request, so
``/v1/models`` answers it with this shape, built from the same :class:`ModelInfo` as the
OpenAI list (verified against Codex 0.171's ``codex debug models`` field names).

Pure: names and infos in, JSON-ready dicts out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.routes.model_info import ModelInfo

#: Codex's ``ModelInfo.base_instructions`` is required, and a served entry replaces the
#: built-in fallback prompt, so an entry must carry one (an empty string would send the
#: model no instructions at all). The gateway's own words; a Codex user replaces them
#: with ``model_instructions_file`` in their config.toml.
BASE_INSTRUCTIONS = """\
You are a coding agent running in the Codex CLI, a terminal-based coding assistant, \
working in the user's workspace through the tools you are given.

- Understand the request, then inspect the workspace (read files, search with rg) before \
changing anything. Follow AGENTS.md files: a file's instructions apply to the directory \
tree it sits in, deeper ones win.
- Run shell commands with the shell tool; set its working directory rather than using cd. \
Edit files with the apply_patch tool when you have it, otherwise through the shell.
- Make the smallest change that does what was asked, in the style of the code around it. \
Do not fix unrelated problems; mention them instead.
- Verify your work when you can (run the tests or the program), and keep going until the \
task is done or you are blocked.
- Respect the sandbox and approval settings you are told about; ask before anything \
destructive that was not requested.
- Finish with a short summary of what you changed and anything left to do, naming files \
with their paths.
"""

#: Codex's ``TruncationPolicyConfig`` for tool output kept in the history: the value its
#: fallback metadata uses.
_TRUNCATION = {"mode": "bytes", "limit": 10_000}

#: Codex's default share of the window usable for input (``effective_context_window_percent``).
_DEFAULT_INPUT_PERCENT = 95

_REASONING_LEVELS = [
    {"effort": "low", "description": "Fast responses with lighter reasoning"},
    {"effort": "medium", "description": "Balances speed and reasoning depth"},
    {"effort": "high", "description": "Greater reasoning depth for complex problems"},
]


def usable_input_percent(info: ModelInfo) -> int:
    """The share of the window Codex may fill with input: what the output cap leaves, at
    most Codex's own 95 % (which reserves 5 % for the answer and tool overhead)."""
    window, output = info.max_input_tokens, info.max_output_tokens
    if window is None or output is None:
        return _DEFAULT_INPUT_PERCENT
    return max(1, min(_DEFAULT_INPUT_PERCENT, (window - output) * 100 // window))


def codex_model(name: str, owner: str, info: ModelInfo) -> dict[str, Any]:
    """One ``ModelInfo`` entry of Codex's catalog (codex-rs ``protocol/src/openai_models.rs``)."""
    caps = info.capabilities
    entry: dict[str, Any] = {
        "slug": name,
        "display_name": name,
        "description": f"{name} through codebuddy2api ({owner})",
        "supported_reasoning_levels": _REASONING_LEVELS if caps.get("reasoning") else [],
        "shell_type": "unified_exec",  # what Codex runs for a model without metadata
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,  # before Codex's bundled models, which the gateway does not serve
        "availability_nux": None,
        "upgrade": None,
        "base_instructions": BASE_INSTRUCTIONS,
        "support_verbosity": False,
        "default_verbosity": None,
        # the gateway translates Codex's freeform apply_patch into a function tool
        "apply_patch_tool_type": "freeform" if caps.get("tools") else None,
        "truncation_policy": _TRUNCATION,
        "effective_context_window_percent": usable_input_percent(info),
        "experimental_supported_tools": [],
        "input_modalities": ["text"] if caps.get("vision") is False else ["text", "image"],
    }
    if caps.get("reasoning"):
        entry["default_reasoning_level"] = "medium"
    if info.max_input_tokens is not None:
        entry["context_window"] = entry["max_context_window"] = info.max_input_tokens
    return entry


def codex_catalog(models: Iterable[tuple[str, str, ModelInfo]]) -> dict[str, Any]:
    """Codex's ``ModelsResponse``: ``{"models": [ModelInfo, ...]}``."""
    return {"models": [codex_model(name, owner, info) for name, owner, info in models]}
