"""``GET /v1/models``: allow-lists, model maps and the upstreams' own lists, through the
openai SDK in strict mode. (Moved from test_pool.py.)"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from gateway.routes.model_info import ModelInfo
from gateway.settings import SettingsError
from gateway.simulator.server import MAX_MODEL_LEN, create_simulator_app
from gateway.upstream.config_file import ModelEntry, load_config_file
from tests.conftest import ServerLoop, Simulator, start_gateway


def test_models_lists_what_the_upstreams_serve(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> None:
    mapped = Simulator(server_loop.serve(create_simulator_app()))
    config = tmp_path_factory.mktemp("models") / "upstreams.toml"
    config.write_text(f"""
[[upstreams]]
name = "mapped"
base_url = "{mapped.url}/v1"
models = ["qwen3-coder"]
model_map = {{"claude-sonnet" = "text"}}
""")
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, config=config)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    listed = {m.id: m.owned_by for m in client.models.list()}
    assert listed["qwen3-coder"] == "mapped" and listed["claude-sonnet"] == "mapped"
    assert listed["parallel_tools"] == "upstream" and listed["echo"] == "upstream"  # the simulator's own list


# -- each model's limits and flags (issue #38) ----------------------------------------------


def test_models_carry_the_upstreams_max_model_len_and_the_config_tables(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The simulator lists ``max_model_len`` as vLLM does: it becomes ``max_input_tokens``;
    a ``[models."<glob>"]`` table adds the output cap and flags (and wins where it states a
    value); both SDKs read them in strict mode."""
    config = tmp_path_factory.mktemp("model-info") / "upstreams.toml"
    config.write_text(f"""
[[upstreams]]
name = "sim"
base_url = "{simulator.url}/v1"

[models."para*"]
max_output_tokens = 8192
capabilities = {{ tools = true, vision = false }}

[models."parallel_tools"]
max_input_tokens = 65536
capabilities = {{ reasoning = true }}
""")
    upstream_list = httpx.get(simulator.url + "/v1/models").json()["data"]
    assert {m["max_model_len"] for m in upstream_list} == {MAX_MODEL_LEN}  # the simulator speaks vLLM
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, config=config)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert listed["echo"]["max_input_tokens"] == MAX_MODEL_LEN and "max_output_tokens" not in listed["echo"]
    assert "capabilities" not in listed["echo"]
    tools = listed["parallel_tools"]
    assert (tools["max_input_tokens"], tools["max_output_tokens"], tools["max_tokens"]) == (65536, 8192, 8192)
    assert tools["capabilities"] == {"reasoning": True, "tools": True, "vision": False}  # later tables add to earlier
    one = client.models.retrieve("parallel_tools").model_dump()
    assert one == tools

    ant = anthropic.Anthropic(base_url=gateway.url, api_key="k", _strict_response_validation=True, max_retries=0)
    claude = {m.id: m for m in ant.models.list()}
    assert (claude["parallel_tools"].max_input_tokens, claude["parallel_tools"].max_tokens) == (65536, 8192)
    assert (claude["echo"].max_input_tokens, claude["echo"].max_tokens) == (MAX_MODEL_LEN, None)
    assert ant.models.retrieve("parallel_tools").max_input_tokens == 65536


def test_model_info_reads_what_upstreams_call_their_limits() -> None:
    assert ModelInfo.from_upstream({"id": "m", "max_model_len": 4096}) == ModelInfo(4096, None)
    assert ModelInfo.from_upstream({"id": "m", "context_length": 200000, "max_completion_tokens": 100}) == ModelInfo(200000, 100)
    for junk in ({"max_model_len": "4096"}, {"max_model_len": 0}, {"max_model_len": True}, {"context_window": -1}):
        assert ModelInfo.from_upstream(junk) == ModelInfo()
    entries = (("q*", ModelEntry(max_output_tokens=1000)), ("qwen", ModelEntry(max_input_tokens=9, capabilities={"tools": False})))
    assert ModelInfo(4096).configured("qwen", entries) == ModelInfo(9, 1000, {"tools": False})
    assert ModelInfo(4096).configured("other", entries) == ModelInfo(4096)
    assert ModelInfo().openai_fields() == {} and ModelInfo().anthropic_fields() == {}


def test_a_bad_model_table_value_is_refused_naming_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    config = tmp_path_factory.mktemp("bad-model-info") / "c.toml"
    config.write_text('[[upstreams]]\nbase_url = "http://127.0.0.1:9/v1"\n\n[models."q*"]\nmax_input_tokens = 0\n'
                      'capabilities = { teleport = true }\n')
    with pytest.raises(SettingsError) as caught:
        load_config_file(config)
    assert f"{config}:5: models.q*.max_input_tokens" in str(caught.value)
