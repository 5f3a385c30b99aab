"""``GET /v1/models?client_version=``: Codex's model catalog (gateway/routes/codex_catalog.py).

The entry's field names and values are checked against Codex's own ``ModelInfo``
(codex-rs ``protocol/src/openai_models.rs``; the names as Codex 0.171's ``codex debug
models`` prints them); tests/clients/test_codex.py runs the real Codex through the recipe."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.routes.codex_catalog import (
    BASE_INSTRUCTIONS,
    codex_catalog,
    codex_model,
    usable_input_percent,
)
from gateway.routes.model_info import ModelInfo
from gateway.simulator.server import MAX_MODEL_LEN
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

#: Every field of Codex 0.171's ``ModelInfo`` (``codex debug models``).
CODEX_FIELDS = {
    "additional_speed_tiers", "apply_patch_tool_type", "availability_nux", "base_instructions", "comp_hash",
    "context_window", "default_reasoning_level", "default_reasoning_summary", "default_service_tier",
    "default_verbosity", "description", "display_name", "effective_context_window_percent",
    "experimental_supported_tools", "include_apps_usage_instructions", "include_plugin_usage_instructions",
    "include_skills_usage_instructions", "input_modalities", "max_context_window", "model_messages",
    "model_specialty", "multi_agent_reasoning_effort", "multi_agent_version", "node_repl_auto_review_required",
    "node_repl_disabled", "priority", "service_tiers", "shell_type", "slug", "support_verbosity", "supported_in_api",
    "supported_reasoning_levels", "supports_experimental_context", "supports_image_detail_original",
    "supports_reasoning_effort_updates", "supports_search_tool", "tool_mode", "truncation_policy", "upgrade",
    "use_responses_lite", "visibility", "web_search_tool_type",
}
#: The ones without a serde default: Codex refuses the whole catalog when one is missing
#: (0.171 without ``base_instructions``: "failed to decode models response").
CODEX_REQUIRED = {
    "slug", "display_name", "description", "supported_reasoning_levels", "shell_type", "visibility",
    "supported_in_api", "priority", "availability_nux", "upgrade", "base_instructions", "support_verbosity",
    "default_verbosity", "apply_patch_tool_type", "truncation_policy", "experimental_supported_tools",
}
STATIC_KEY = "ck-static-client-key-0001"


def assert_codex_reads(entry: dict[str, Any]) -> None:
    """Field names Codex knows, the required ones present, values of its enums' spellings."""
    assert CODEX_REQUIRED <= set(entry) <= CODEX_FIELDS
    assert entry["shell_type"] in {"unified_exec", "disabled"}  # ConfigShellToolType
    assert entry["visibility"] in {"list", "hide", "none"}  # ModelVisibility
    assert entry["apply_patch_tool_type"] in {"freeform", None}  # Option<ApplyPatchToolType>
    assert entry["truncation_policy"]["mode"] in {"bytes", "tokens"} and entry["truncation_policy"]["limit"] > 0
    assert {level["effort"] for level in entry["supported_reasoning_levels"]} <= {"none", "minimal", "low", "medium", "high", "xhigh"}
    assert set(entry["input_modalities"]) <= {"text", "image"}  # InputModality
    assert isinstance(entry["base_instructions"], str) and entry["base_instructions"].strip()
    assert isinstance(entry["priority"], int) and 1 <= entry["effective_context_window_percent"] <= 100


def test_an_entry_field_by_field() -> None:
    info = ModelInfo(131072, 16384, {"tools": True, "reasoning": True, "vision": False})
    entry = codex_model("qwen3-coder", "vllm-a", info)
    assert entry == {
        "slug": "qwen3-coder",
        "display_name": "qwen3-coder",
        "description": "qwen3-coder through codebuddy2api (vllm-a)",
        "default_reasoning_level": "medium",
        "supported_reasoning_levels": [
            {"effort": "low", "description": "Fast responses with lighter reasoning"},
            {"effort": "medium", "description": "Balances speed and reasoning depth"},
            {"effort": "high", "description": "Greater reasoning depth for complex problems"},
        ],
        "shell_type": "unified_exec",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "availability_nux": None,
        "upgrade": None,
        "base_instructions": BASE_INSTRUCTIONS,
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": "freeform",
        "truncation_policy": {"mode": "bytes", "limit": 10000},
        "context_window": 131072,
        "max_context_window": 131072,
        "effective_context_window_percent": 87,  # (131072 - 16384) / 131072
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }
    assert_codex_reads(entry)


def test_an_entry_of_a_model_nobody_described_states_no_window() -> None:
    entry = codex_model("m", "up", ModelInfo())
    assert_codex_reads(entry)
    assert "context_window" not in entry and "max_context_window" not in entry  # no guess
    assert "default_reasoning_level" not in entry and entry["supported_reasoning_levels"] == []
    assert entry["apply_patch_tool_type"] is None  # what Codex's fallback has: edits through the shell
    assert entry["input_modalities"] == ["text", "image"] and entry["effective_context_window_percent"] == 95
    assert codex_model("m", "up", ModelInfo(capabilities={"vision": True}))["input_modalities"] == ["text", "image"]
    assert codex_catalog([("a", "up", ModelInfo()), ("b", "up", ModelInfo(4096))])["models"][1]["context_window"] == 4096


def test_the_share_of_the_window_left_for_input() -> None:
    assert usable_input_percent(ModelInfo(131072, 16384)) == 87
    assert usable_input_percent(ModelInfo(1000, 10)) == 95  # never more than Codex's own default
    assert usable_input_percent(ModelInfo(1000, 1000)) == 1 and usable_input_percent(ModelInfo(1000, 5000)) == 1
    assert usable_input_percent(ModelInfo(None, 100)) == usable_input_percent(ModelInfo(1000, None)) == 95


@pytest.fixture(scope="module")
def gw(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    config = tmp_path_factory.mktemp("codex-catalog") / "upstreams.toml"
    config.write_text(f"""
[[upstreams]]
name = "sim"
base_url = "{simulator.url}/v1"

[models."parallel_tools"]
max_input_tokens = 65536
max_output_tokens = 8192
capabilities = {{ tools = true, reasoning = true }}
""")
    return start_gateway(server_loop, simulator, tmp_path_factory, config=config, api_key=[STATIC_KEY])


def catalog(gw: Gateway, key: str, path: str = "/v1/models") -> httpx.Response:
    return httpx.get(gw.url + path, params={"client_version": "0.171.0"}, headers={"authorization": f"Bearer {key}"})


def test_codex_gets_its_catalog_of_the_same_models(gw: Gateway) -> None:
    answer = catalog(gw, STATIC_KEY)
    assert answer.status_code == 200 and set(answer.json()) == {"models"}
    models = {m["slug"]: m for m in answer.json()["models"]}
    for entry in models.values():
        assert_codex_reads(entry)
    listed = openai.OpenAI(base_url=gw.base_url, api_key=STATIC_KEY, _strict_response_validation=True, max_retries=0).models.list()
    assert sorted(models) == sorted(m.id for m in listed)  # the OpenAI list without client_version: unchanged
    tools = models["parallel_tools"]
    assert (tools["context_window"], tools["effective_context_window_percent"]) == (65536, 87)
    assert tools["apply_patch_tool_type"] == "freeform" and tools["default_reasoning_level"] == "medium"
    echo = models["echo"]  # the upstream's own max_model_len, no table
    assert (echo["context_window"], echo["apply_patch_tool_type"]) == (MAX_MODEL_LEN, None)
    rollout = catalog(gw, STATIC_KEY, "/rollouts/r-codex/v1/models")  # a rollout base_url asks the same
    assert rollout.status_code == 200 and rollout.json() == answer.json()


def test_the_catalog_is_behind_the_client_keys_and_their_globs(gw: Gateway) -> None:
    refused = catalog(gw, "sk-not-a-key-of-this-gateway")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    created = httpx.post(gw.url + "/admin/api/keys", json={"name": "codex-team", "models": ["parallel*", "echo"]}, headers=gw.admin)
    assert created.status_code == 201, created.text
    slugs = [m["slug"] for m in catalog(gw, created.json()["key"]).json()["models"]]
    assert slugs and set(slugs) <= {"echo"} | {s for s in slugs if s.startswith("parallel")}
    assert "echo" in slugs and "parallel_tools" in slugs and "reasoning" not in slugs
    assert len(catalog(gw, STATIC_KEY).json()["models"]) > len(slugs)  # the static key still sees them all
