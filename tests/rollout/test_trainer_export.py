"""The trainer's side of a rollout (docs/capture.md): the capture export that reads the
store in every capture mode (admin route and CLI), rewards and groups, the bulk export in
each trainer's shape. Rollouts are driven through the running app with the official SDKs,
in front of the simulator's vLLM token fields."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.simulator.scenarios import assemble_completion, build_plan
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway, wait_for

CLIENT_KEY = "ck-trainer-export-key-0123456789"
CALLS = 'CALL get_weather {"city": "Paris"} then CALL get_time {"timezone": "Europe/Paris"}'
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "timezone": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")]


@pytest.fixture(scope="module")
def trainer_gateway(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY])


def new_rollout(kind: str) -> str:
    return f"{kind}.{secrets.token_hex(4)}:r-1"


def client_for(gateway: Gateway, rollout: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout}/v1", api_key=CLIENT_KEY,
                         _strict_response_validation=True, max_retries=0, default_headers=headers)


def read_back(gateway: Gateway, rollout: str, part: str = "") -> dict[str, Any]:
    response = httpx.get(f"{gateway.url}/admin/api/rollouts/{rollout}{part}", headers=gateway.admin, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def expected_tokens(body: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """What the simulator sampled for this upstream body: prompt ids, completion ids, logprobs."""
    folded = assemble_completion(build_plan(body["model"], body).frames, body["model"])
    choice = folded["choices"][0]
    return folded["prompt_token_ids"], choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]


def edited_rollout(gateway: Gateway, rollout: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Three calls: two tool turns in one chain, then a call whose history was edited (a
    rewritten tool result): two segments. The upstream bodies, in order."""
    client = client_for(gateway, rollout, headers)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{secrets.token_hex(6)}: {CALLS}"}]
    for _ in range(2):
        message = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=TOOLS).choices[0].message  # type: ignore[arg-type]
        assert message.tool_calls
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
    messages[2] = {**messages[2], "content": "get_weather says 19 C"}  # the harness edits its history
    final = client.chat.completions.create(model="agent;chunk=7", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert final.choices[0].message.content and final.choices[0].message.content.startswith("Done.")
    return [c["upstream_request"] for c in read_back(gateway, rollout)["calls"]]


# -- 1. the capture export reads the store --------------------------------------------------


def test_the_admin_capture_export_reads_the_store_without_a_capture_dir(trainer_gateway: Gateway) -> None:
    gateway, rollout = trainer_gateway, new_rollout("export")
    edited_rollout(gateway, rollout)
    url, admin = gateway.url + "/admin/api/capture/export", gateway.admin
    response = httpx.get(url, params={"rollout": rollout}, headers=admin)
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    exported = [json.loads(line) for line in response.text.splitlines()]
    assert exported == read_back(gateway, rollout)["calls"] and len(exported) == 3
    assert [r["seq"] for r in exported] == [0, 1, 2] and all(r["tokens"]["completion_ids"] for r in exported)
    unknown = httpx.get(url, params={"rollout": "no-such-rollout"}, headers=admin)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "rollout_not_found"
    files = httpx.get(url, params={"rollout": rollout, "source": "files"}, headers=admin)
    assert files.status_code == 404 and files.json()["error"]["code"] == "capture_disabled"
    for params, code in (({"rollout": "bad id"}, "invalid_rollout_id"), ({}, "missing_parameter"),
                         ({"rollout": rollout, "source": "disk"}, "invalid_parameter")):
        bad = httpx.get(url, params=params, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == code


def export_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``capture export`` run from ``cwd``, with no gateway settings in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run([sys.executable, "-m", "gateway", "capture", "export", *args],
                          capture_output=True, timeout=60, env=env, cwd=cwd)


def test_the_cli_export_reads_an_existing_store_and_never_creates_one(trainer_gateway: Gateway, tmp_path: Path) -> None:
    gateway, rollout = trainer_gateway, new_rollout("cli")
    edited_rollout(gateway, rollout)
    data_dir = str(gateway.live.current.data_dir)
    out = export_cli(tmp_path, "--rollout", rollout, "--data-dir", data_dir)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == read_back(gateway, rollout)["calls"]
    by_url = export_cli(tmp_path, "--rollout", rollout, "--database-url", f"sqlite:///{data_dir}/codebuddy2api.sqlite3")
    assert by_url.returncode == 0 and by_url.stdout == out.stdout
    unknown = export_cli(tmp_path, "--rollout", "no-such-rollout", "--data-dir", data_dir)
    assert (unknown.returncode, unknown.stdout) == (1, b"")
    assert unknown.stderr.decode() == "codebuddy2api: error: no rollout 'no-such-rollout' in the store\n"
    # from a folder without a store: one line, non-zero, and no ./data created there
    missing = export_cli(tmp_path, "--rollout", rollout)
    assert (missing.returncode, missing.stdout) == (2, b"")
    assert missing.stderr.decode() == ("codebuddy2api: error: no store at data/codebuddy2api.sqlite3 "
                                       "(give --data-dir or --database-url)\n")
    elsewhere = export_cli(tmp_path, "--rollout", rollout, "--database-url", f"sqlite:///{tmp_path}/none.sqlite3")
    assert elsewhere.returncode == 2 and elsewhere.stderr.decode().count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_exports_read_a_postgresql_store(server_loop: ServerLoop, simulator: Simulator, postgres_schema: str,
                                             tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    gateway = start_gateway(server_loop, simulator, tmp_path_factory, capture_tokens="vllm", api_key=[CLIENT_KEY],
                            database_url=postgres_schema)
    rollouts = [new_rollout("pg") for _ in range(3)]
    for rollout in rollouts:
        client_for(gateway, rollout, {"x-rollout-group": "pg-group"}).chat.completions.create(
            model="text", messages=[{"role": "user", "content": "hi"}])
    out = export_cli(tmp_path, "--rollout", rollouts[0], "--database-url", postgres_schema)
    assert out.returncode == 0, out.stderr
    [record] = [json.loads(line) for line in out.stdout.splitlines()]
    assert record == read_back(gateway, rollouts[0])["calls"][0] and record["outcome"] == "success"
    # the bulk export's page query on PostgreSQL: group, frozen, cursor, a reward in the shape
    assert post(gateway, rollouts[1], "reward", {"reward": 2}).status_code == 200
    assert post(gateway, rollouts[1], "freeze", {}).status_code == 200
    lines = bulk(gateway, group="pg-group", shape="verifiers")
    assert [line["rollout_id"] for line in lines] == [rollouts[0], rollouts[2], rollouts[1]]
    assert [line["reward"] for line in lines] == [None, None, 2.0]
    assert lines[0]["completion_ids"] == record["tokens"]["completion_ids"]
    assert [line["rollout_id"] for line in bulk(gateway, group="pg-group", cursor=lines[0]["cursor"], frozen="false")] == [rollouts[2]]


# -- 2. rewards and groups ------------------------------------------------------------------


def post(gateway: Gateway, rollout: str, part: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}/admin/api/rollouts/{rollout}/{part}", json=body, headers=gateway.admin, timeout=10)


def listed(gateway: Gateway, **params: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(gateway.url + "/admin/api/rollouts", params=params, headers=gateway.admin, timeout=10)
    assert response.status_code == 200, response.text
    return {r["rollout_id"]: r for r in response.json()["rollouts"]}


def test_rewards_and_groups_round_trip(trainer_gateway: Gateway, simulator: Simulator) -> None:
    gateway, group = trainer_gateway, "grpo.step7:" + secrets.token_hex(3)
    rollout, other = new_rollout("rew"), new_rollout("rew")
    edited_rollout(gateway, rollout, {"x-rollout-group": group})
    client_for(gateway, other).chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])
    snap = read_back(gateway, rollout)
    assert snap["group_id"] == group and snap["reward"] is None and snap["call_rewards"] == {}
    assert [c["group_id"] for c in snap["calls"]] == [group] * 3
    assert read_back(gateway, other)["group_id"] is None
    assert set(listed(gateway, group=group)) == {rollout}
    # the rollout's reward: posted twice (a retry) it is one reward; a new value replaces it
    first = post(gateway, rollout, "reward", {"reward": 1, "details": {"tests_passed": 3}})
    assert first.status_code == 200, first.text
    assert first.json() | {"at": 0} == {"rollout_id": rollout, "call_id": None, "reward": 1.0,
                                        "details": {"tests_passed": 3}, "at": 0}
    assert post(gateway, rollout, "reward", {"reward": 1, "details": {"tests_passed": 3}}).status_code == 200
    assert read_back(gateway, rollout)["reward"] | {"at": 0} == {"reward": 1.0, "details": {"tests_passed": 3}, "at": 0}
    assert post(gateway, rollout, "reward", {"reward": 0.25}).status_code == 200
    call_ids = [c["call_id"] for c in snap["calls"]]
    assert post(gateway, rollout, "reward", {"reward": -0.5, "call_id": call_ids[1]}).status_code == 200
    assert post(gateway, rollout, "reward", {"reward": -1.5, "call_id": call_ids[1], "details": {"why": "x"}}).status_code == 200
    snap = read_back(gateway, rollout)
    assert (snap["reward"]["reward"], snap["reward"]["details"]) == (0.25, None)
    assert {k: (v["reward"], v["details"]) for k, v in snap["call_rewards"].items()} == {call_ids[1]: (-1.5, {"why": "x"})}
    assert gateway.app.state.db.execute("SELECT COUNT(*) FROM rollout_rewards WHERE rollout_id = ?", (rollout,)) == [(2,)]
    entry = listed(gateway, group=group)[rollout]
    assert (entry["group_id"], entry["reward"], entry["calls"]) == (group, 0.25, 3)
    # the admin API moves a rollout into a group
    moved = post(gateway, other, "group", {"group_id": group})
    assert moved.status_code == 200 and moved.json() == {"rollout_id": other, "group_id": group}
    assert set(listed(gateway, group=group)) == {rollout, other}
    # deleting a frozen rollout deletes its labels too
    assert post(gateway, other, "freeze", {}).status_code == 200
    assert httpx.request("DELETE", f"{gateway.url}/admin/api/rollouts/{other}", json={}, headers=gateway.admin).status_code == 204
    assert set(listed(gateway, group=group)) == {rollout}
    assert gateway.app.state.db.execute("SELECT COUNT(*) FROM rollout_groups WHERE rollout_id = ?", (other,)) == [(0,)]


@pytest.mark.parametrize("body,status,code,param", [
    ({"reward": True}, 400, "invalid_parameter", "reward"),
    ({"reward": "1"}, 400, "invalid_parameter", "reward"),
    ({}, 400, "invalid_parameter", "reward"),
    ({"reward": 1, "details": [1]}, 400, "invalid_parameter", "details"),
    ({"reward": 1, "call_id": 7}, 400, "invalid_parameter", "call_id"),
    ({"reward": 1, "score": 2}, 400, "invalid_parameter", "score"),
    ({"reward": 1, "call_id": "req_nope"}, 404, "call_not_found", "call_id"),
    ([1], 400, "invalid_json", None),
])
def test_a_bad_reward_is_refused_with_the_field(trainer_gateway: Gateway, body: Any, status: int, code: str, param: str | None) -> None:
    gateway, rollout = trainer_gateway, new_rollout("bad")
    client_for(gateway, rollout).chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])
    response = post(gateway, rollout, "reward", body)
    assert response.status_code == status, response.text
    assert (response.json()["error"]["code"], response.json()["error"].get("param")) == (code, param)
    assert read_back(gateway, rollout)["reward"] is None and read_back(gateway, rollout)["call_rewards"] == {}


def test_labels_need_a_rollout_and_valid_values(trainer_gateway: Gateway, simulator: Simulator) -> None:
    gateway = trainer_gateway
    missing = post(gateway, "no-such-rollout", "reward", {"reward": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "rollout_not_found"
    rollout = new_rollout("grp")
    client_for(gateway, rollout).chat.completions.create(model="text", messages=[{"role": "user", "content": "hi"}])
    nan = httpx.post(f"{gateway.url}/admin/api/rollouts/{rollout}/reward", content=b'{"reward": NaN}',
                     headers={**gateway.admin, "content-type": "application/json"})
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "reward"
    bad_group = post(gateway, rollout, "group", {"group_id": "has space"})
    assert bad_group.status_code == 400 and bad_group.json()["error"]["param"] == "group_id"
    assert httpx.get(gateway.url + "/admin/api/rollouts", params={"group": "a/b"}, headers=gateway.admin).status_code == 400
    # a bad group header on a call: the route's 400 before anything goes upstream
    before = len(simulator.requests())
    with pytest.raises(openai.BadRequestError) as refused:
        client_for(gateway, new_rollout("grp"), {"x-rollout-group": "no/slash"}).chat.completions.create(
            model="text", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "invalid_rollout_group" and refused.value.param == "x-rollout-group"
    assert len(simulator.requests()) == before


# -- 3. the bulk export in each trainer's shape ---------------------------------------------


def bulk(gateway: Gateway, **params: str) -> list[dict[str, Any]]:
    with httpx.stream("GET", gateway.url + "/admin/api/rollouts/export", params=params, headers=gateway.admin,
                      timeout=30) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.iter_lines() if line]


def expected_segments(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """From the simulator's own tokens: calls 0 and 1 form one chain, call 2 (an edited
    history) its own. Prompt = the first call's prompt; completion = the rest; mask 1 on
    sampled tokens; logprobs 0.0 elsewhere."""
    (p0, c0, l0), (p1, c1, l1), (p2, c2, l2) = (expected_tokens(b) for b in bodies)
    assert (p1 + c1)[: len(p0) + len(c0)] == p0 + c0  # call 1 extends call 0 token for token
    assert (p2 + c2)[: len(p1)] != p1  # call 2's history was edited
    completion = (p1 + c1)[len(p0):]
    mask = [1] * len(c0) + [0] * (len(p1) - len(p0) - len(c0)) + [1] * len(c1)
    logprobs = l0 + [0.0] * (len(p1) - len(p0) - len(c0)) + l1
    return [{"prompt": p0, "completion": completion, "mask": mask, "logprobs": logprobs, "calls": [(p0, c0, l0), (p1, c1, l1)]},
            {"prompt": p2, "completion": c2, "mask": [1] * len(c2), "logprobs": l2, "calls": [(p2, c2, l2)]}]


@pytest.fixture(scope="module")
def scored_rollout(trainer_gateway: Gateway) -> dict[str, Any]:
    """A 3-call rollout with an edit (two segments), in a group of its own, with a reward
    of its own and one on its second call."""
    gateway, rollout, group = trainer_gateway, new_rollout("shape"), "shapes-" + secrets.token_hex(4)
    bodies = edited_rollout(gateway, rollout, {"x-rollout-group": group})
    call_ids = [c["call_id"] for c in read_back(gateway, rollout)["calls"]]
    assert post(gateway, rollout, "reward", {"reward": 0.75, "details": {"judge": "unit tests"}}).status_code == 200
    assert post(gateway, rollout, "reward", {"reward": -1, "call_id": call_ids[1]}).status_code == 200
    return {"rollout": rollout, "group": group, "bodies": bodies, "call_ids": call_ids}


def test_the_native_shape_is_the_read_back_with_segments_and_rewards(trainer_gateway: Gateway, scored_rollout: dict[str, Any]) -> None:
    gateway, rollout = trainer_gateway, scored_rollout["rollout"]
    [line] = bulk(gateway, group=scored_rollout["group"])  # native is the default shape
    snap, trajectory = read_back(gateway, rollout), read_back(gateway, rollout, "/trajectory")
    assert line["calls"] == snap["calls"] and line["segments"] == trajectory["segments"]
    assert (line["rollout_id"], line["group_id"], line["complete"], line["frozen"]) == (rollout, scored_rollout["group"], True, False)
    assert line["reward"] == snap["reward"] and line["reward"]["reward"] == 0.75
    assert {k: v["reward"] for k, v in line["call_rewards"].items()} == {scored_rollout["call_ids"][1]: -1.0}
    assert [s["call_ids"] for s in line["segments"]] == [scored_rollout["call_ids"][:2], scored_rollout["call_ids"][2:]]
    assert line["updated_at"] == pytest.approx(snap["calls"][-1]["ended_at"])


def test_the_nemo_gym_shape_has_a_token_entry_per_call(trainer_gateway: Gateway, scored_rollout: dict[str, Any]) -> None:
    lines = bulk(trainer_gateway, group=scored_rollout["group"], shape="nemo-gym")
    expected, ids = expected_segments(scored_rollout["bodies"]), scored_rollout["call_ids"]
    assert [(line["segment"], line["segment_count"], line["call_ids"]) for line in lines] == [(0, 2, ids[:2]), (1, 2, ids[2:])]
    for line, segment in zip(lines, expected):
        assert line["output"] == [{"call_id": c, "prompt_token_ids": p, "generation_token_ids": g, "generation_log_probs": lp,
                                   "weight_versions": []}
                                  for c, (p, g, lp) in zip(line["call_ids"], segment["calls"])]
        assert line["reward"] == 0.75 and line["rollout_id"] == scored_rollout["rollout"]
        # what NeMo RL checks when it merges the turns of one sample: each prompt starts with all that was seen
        seen: list[int] = []
        for entry in line["output"]:
            assert entry["prompt_token_ids"][: len(seen)] == seen
            seen = entry["prompt_token_ids"] + entry["generation_token_ids"]
    assert lines[0]["call_rewards"] == {ids[1]: -1.0} and lines[1]["call_rewards"] == {}


@pytest.mark.parametrize("shape,names", [
    ("trl", ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward")),
    ("verifiers", ("prompt_ids", "completion_ids", "completion_logprobs", "completion_mask", "reward")),
])
def test_the_flat_shapes_have_masked_completions(trainer_gateway: Gateway, scored_rollout: dict[str, Any], shape: str,
                                                 names: tuple[str, str, str, str, str]) -> None:
    lines = bulk(trainer_gateway, group=scored_rollout["group"], shape=shape)
    prompt, completion, logprobs, mask, reward = names
    expected = expected_segments(scored_rollout["bodies"])
    assert len(lines) == 2
    for line, segment in zip(lines, expected):
        assert line[prompt] == segment["prompt"] and line[completion] == segment["completion"]
        assert line[mask] == segment["mask"] and line[logprobs] == segment["logprobs"]
        assert len(line[completion]) == len(line[mask]) == len(line[logprobs])
        assert line[reward] == 0.75 and line["group_id"] == scored_rollout["group"]
    assert 0 in lines[0][mask]  # the tool results between the two turns are the environment's


def test_the_bulk_export_filters_pages_and_resumes(trainer_gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.rollout import bulk_export

    gateway, group = trainer_gateway, "page-" + secrets.token_hex(4)
    rollouts = [new_rollout(f"page{n}") for n in range(5)]
    for rollout in rollouts:
        client_for(gateway, rollout, {"x-rollout-group": group}).chat.completions.create(
            model="text", messages=[{"role": "user", "content": "hi"}])
    monkeypatch.setattr(bulk_export, "PAGE_ROLLOUTS", 2)  # three pages
    lines = bulk(gateway, group=group)
    assert [line["rollout_id"] for line in lines] == rollouts  # oldest update first
    updated = [line["updated_at"] for line in lines]
    assert updated == sorted(updated)
    resumed = bulk(gateway, group=group, cursor=lines[1]["cursor"])
    assert [line["rollout_id"] for line in resumed] == rollouts[2:]
    assert bulk(gateway, group=group, cursor=lines[4]["cursor"]) == []
    window = bulk(gateway, group=group, since=repr(updated[1]), until=repr(updated[3]))
    assert [line["rollout_id"] for line in window] == rollouts[1:3]
    for rollout in rollouts[:2]:
        assert post(gateway, rollout, "freeze", {}).status_code == 200
    assert [line["rollout_id"] for line in bulk(gateway, group=group, frozen="false")] == rollouts[2:]
    frozen = bulk(gateway, group=group, frozen="true")
    assert [line["rollout_id"] for line in frozen] == rollouts[:2] and all(line["frozen"] for line in frozen)
    # a rollout changed after its export (frozen) comes again after the cursor
    again = bulk(gateway, group=group, cursor=lines[4]["cursor"])
    assert [line["rollout_id"] for line in again] == rollouts[:2]


@pytest.mark.parametrize("params,param", [
    ({"shape": "openrlhf"}, "shape"), ({"format": "csv"}, "format"), ({"frozen": "maybe"}, "frozen"),
    ({"group": "a b"}, "group"), ({"cursor": "not-a-cursor"}, "cursor"), ({"since": "yesterday"}, "since"),
    ({"undelivered": "drop"}, "undelivered"),
])
def test_bad_bulk_export_parameters_are_a_400(trainer_gateway: Gateway, params: dict[str, str], param: str) -> None:
    response = httpx.get(trainer_gateway.url + "/admin/api/rollouts/export", params=params, headers=trainer_gateway.admin)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_bad_undelivered_choice_on_a_trajectory_is_a_400(trainer_gateway: Gateway) -> None:
    response = httpx.get(trainer_gateway.url + "/admin/api/rollouts/any-rollout/trajectory",
                         params={"undelivered": "drop"}, headers=trainer_gateway.admin)
    assert response.status_code == 400 and response.json()["error"]["param"] == "undelivered"


def test_a_rollout_without_token_ids_has_no_segment_lines(trainer_gateway: Gateway) -> None:
    gateway, group = trainer_gateway, "noids-" + secrets.token_hex(4)
    rollout = new_rollout("noids")
    with pytest.raises(openai.APIError):  # the upstream fails mid-stream: a partial answer, no token set
        with client_for(gateway, rollout, {"x-rollout-group": group}).chat.completions.stream(
                model="error_frame", messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_completion()
    wait_for(lambda: len(bulk(gateway, group=group)) == 1)  # a failed call's record and group: written as it ends
    [native] = bulk(gateway, group=group)
    assert native["segments"] == [] and native["calls"][0]["tokens"] is None and native["calls"][0]["outcome"] == "error"
    for shape in ("nemo-gym", "trl", "verifiers"):
        assert bulk(gateway, group=group, shape=shape) == []


def test_the_status_api_says_capture_is_on_with_its_token_source(trainer_gateway: Gateway, gateways: dict[str, Gateway]) -> None:
    def capture(gateway: Gateway) -> Any:
        response = httpx.get(gateway.url + "/admin/api/status", headers=gateway.admin)
        assert response.status_code == 200
        return response.json()["capture"]

    assert capture(trainer_gateway) == {"token_sources": {"upstream": "vllm"}, "token_in": {}, "strict": False, "files": None}
    assert capture(gateways["compatible"]) is None  # no capture setting: the WebUI says nothing


def test_every_shape_carries_weight_versions_that_change_mid_call(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The 3-call rollout with an edit at an engine (``--engine-api vllm``) whose weights
    change in the middle of the second call (a gateway-held pause, resumed on v2): each shape
    says which version sampled which token, at the exact offset into its own completion."""
    from tests.engines.test_weight_sync import engine_gateway, engine_state

    gateway, simulator = engine_gateway(server_loop, tmp_path_factory, capture_tokens="vllm", stream_mode="realtime",
                                        api_key=[CLIENT_KEY])
    rollout, group = new_rollout("versions"), "versions-" + secrets.token_hex(4)
    client = client_for(gateway, rollout, {"x-rollout-group": group})
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{secrets.token_hex(6)}: {CALLS}"}]

    def turn(model: str) -> Any:
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message  # type: ignore[arg-type]
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name} says 18 C"})
        return message

    assert turn("agent;chunk=7").tool_calls
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(turn, "agent;chunk=2;delay=0.05")  # slow enough to pause it midway
        wait_for(lambda: engine_state(simulator)["in_flight"] == 1, timeout=15)
        time.sleep(0.15)  # a few tokens into the answer
        assert httpx.post(gateway.url + "/admin/api/engines/pause", json={}, headers=gateway.admin).status_code == 200
        resumed = httpx.post(gateway.url + "/admin/api/engines/resume", json={"weight_version": "v2"}, headers=gateway.admin)
        assert resumed.status_code == 200, resumed.text
        assert second.result(timeout=60).tool_calls
    messages[2] = {**messages[2], "content": "get_weather says 19 C"}  # the harness edits its history
    assert turn("agent;chunk=7").content.startswith("Done.")

    calls = read_back(gateway, rollout)["calls"]
    ids, versions = [c["call_id"] for c in calls], [c["weight_versions"] for c in calls]
    assert versions[0] == [{"version": "default", "from_token": 0}]
    assert versions[2] == [{"version": "v2", "from_token": 0}]
    before, switch = versions[1]
    k = switch["from_token"]
    assert before == {"version": "default", "from_token": 0} and switch["version"] == "v2"
    assert 0 < k < len(calls[1]["tokens"]["completion_ids"])

    nemo = bulk(gateway, group=group, shape="nemo-gym")
    assert [line["call_ids"] for line in nemo] == [ids[:2], ids[2:]]
    assert [[entry["weight_versions"] for entry in line["output"]] for line in nemo] == [versions[:2], versions[2:]]
    # in the flat shapes: offsets into the line's completion (which begins after call 0's prompt)
    at = len(calls[1]["tokens"]["prompt_ids"]) - len(calls[0]["tokens"]["prompt_ids"])  # call 1's first sampled token
    expected = [[{"call_id": ids[0], "version": "default", "from_token": 0},
                 {"call_id": ids[1], "version": "default", "from_token": at},
                 {"call_id": ids[1], "version": "v2", "from_token": at + k}],
                [{"call_id": ids[2], "version": "v2", "from_token": 0}]]
    for shape, mask in (("trl", "env_mask"), ("verifiers", "completion_mask")):
        lines = bulk(gateway, group=group, shape=shape)
        assert [line["weight_versions"] for line in lines] == expected, shape
        first = lines[0]
        assert first["completion_ids"][at + k] == calls[1]["tokens"]["completion_ids"][k] and first[mask][at + k] == 1
        assert first[mask][at - 1] == 0 and first[mask][at] == 1  # the tool results end where call 1 samples
    # the Parquet export carries the same versions in its typed columns
    from tests.rollout.test_parquet_export import as_records, parquet

    for shape in ("nemo-gym", "trl", "verifiers"):
        assert as_records(shape, parquet(gateway, group=group, shape=shape)) == bulk(gateway, group=group, shape=shape)
