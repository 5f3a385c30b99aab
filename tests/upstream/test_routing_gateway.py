"""Routing through a running gateway (docs/routing.md): several simulators act as the
replicas of one engine; which one each call reached is read from their request logs, why
from the audit record, how many from /metrics."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.settings import Settings
from gateway.simulator.reply import TEXT
from gateway.simulator.server import create_simulator_app
from gateway.upstream.routing import PACE_MIN_SAMPLES
from tests.conftest import Gateway, ServerLoop, Simulator, wait_for


@pytest.fixture(scope="module")
def replicas(server_loop: ServerLoop) -> list[Simulator]:
    return [Simulator(server_loop.serve(create_simulator_app())) for _ in range(4)]


@pytest.fixture(autouse=True)
def _fresh(replicas: list[Simulator]) -> None:
    for sim in replicas:
        httpx.delete(sim.url + "/_sim/fault")
        sim.clear()


def start(server_loop: ServerLoop, data_dir: Path, sims: list[Simulator], **overrides: Any) -> Gateway:
    overrides.setdefault("spill_max_bytes", 1 << 20)
    overrides.setdefault("keepalive_interval", 0.5)
    settings = Settings(upstream_url=[s.url + "/v1" for s in sims], data_dir=data_dir, **overrides)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


def calls(sim: Simulator) -> list[dict[str, Any]]:
    return [r for r in sim.requests() if r["path"].endswith("/chat/completions")]


def served_by(sims: list[Simulator]) -> list[int]:
    return [len(calls(s)) for s in sims]


def conversation(topic: str, turns: int) -> list[dict[str, Any]]:
    """A growing agent history: the topic's system prompt, then user/assistant turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are the careful agent of {topic}. " * 20}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": f"{TEXT} ({topic} {turn})"})
        messages.append({"role": "user", "content": f"{topic}: step {turn}"})
    return messages


def ask(gateway: Gateway, messages: list[dict[str, Any]], base_url: str | None = None,
        headers: dict[str, str] | None = None, model: str = "text;chunk=7") -> str:
    """One streamed call through the strict SDK; returns the request id."""
    client = openai.OpenAI(base_url=base_url or gateway.base_url, api_key="k", default_headers=headers or {},
                           _strict_response_validation=True, max_retries=0, timeout=20)
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, stream=True)  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == TEXT
    return raw.headers["x-request-id"]


def attempts(gateway: Gateway, request_id: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        response = httpx.get(f"{gateway.url}/admin/api/audit/{request_id}", headers=gateway.admin)
        if response.status_code == 200:
            return response.json()["upstream_attempts"]  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"{request_id} never reached the audit store"
        time.sleep(0.05)


def routed(gateway: Gateway, request_id: str) -> list[tuple[str, str]]:
    return [(a["upstream"], a["routing"]) for a in attempts(gateway, request_id)]


def metric(gateway: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class Held:
    """Calls kept in flight until the test ends, whatever the machine's pace: each is a raw
    request for a late answer (the simulator's first byte in ``TTFB`` s), its socket closed
    when the test is over (the gateway then drops the upstream call)."""

    TTFB = 45

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []

    def hold(self, gateway: Gateway, messages: list[dict[str, Any]], headers: dict[str, str] | None = None) -> None:
        body = json.dumps({"model": f"text;ttfb={self.TTFB}", "messages": messages, "stream": True}).encode()
        url = httpx.URL(gateway.base_url)
        head = {"Host": f"{url.host}:{url.port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
                **(headers or {})}
        sock = socket.create_connection((url.host, url.port or 80), timeout=10)
        self.sockets.append(sock)
        request = f"POST {url.path}/chat/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
        sock.sendall(request.encode() + b"\r\n" + body)

    def release(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def held() -> Iterator[Held]:
    holds = Held()
    yield holds
    holds.release()


# -- rule 1: a named session stays on its replica ------------------------------------------


@pytest.mark.parametrize("naming", ["rollout_route", "rollout_header", "session_header"])
def test_each_session_stays_on_one_replica(server_loop: ServerLoop, replicas: list[Simulator], tmp_path: Path,
                                           naming: str) -> None:
    gateway = start(server_loop, tmp_path, replicas, session_header="x-conversation")
    homes = {}
    for session in ("s-1", "s-2", "s-3", "s-4"):
        before = served_by(replicas)
        ids = []
        for turn in range(1, 4):
            base_url, headers = None, None
            if naming == "rollout_route":
                base_url = f"{gateway.url}/rollouts/{session}/v1"
            else:
                headers = {"x-rollout-id" if naming == "rollout_header" else "x-conversation": session}
            ids.append(ask(gateway, conversation(session, turn), base_url, headers))
        grew = [after - b for after, b in zip(served_by(replicas), before)]
        assert sorted(grew) == [0, 0, 0, 3], grew  # all three turns on one replica
        homes[session] = grew.index(3)
        reasons = [routed(gateway, i) for i in ids]
        assert [r[0][1] for r in reasons[1:]] == ["session", "session"]
        assert {r[0][0] for r in reasons} == {f"upstream{homes[session]}"}
    assert len(set(homes.values())) > 1  # new sessions spread while the replicas are idle


# -- rule 2: without a session, the replica that was sent the prefix -----------------------


def test_a_call_without_a_session_follows_its_prefix(server_loop: ServerLoop, replicas: list[Simulator],
                                                     tmp_path: Path) -> None:
    gateway = start(server_loop, tmp_path, replicas)
    first = {}
    for topic in ("alpha", "beta", "gamma"):
        before = served_by(replicas)
        ask(gateway, conversation(topic, 1))
        first[topic] = [a - b for a, b in zip(served_by(replicas), before)].index(1)
    assert len(set(first.values())) == 3  # new prompts spread while the replicas are idle
    for topic in ("alpha", "beta", "gamma"):  # the next turns, interleaved
        for turn in (2, 3):
            before = served_by(replicas)
            request_id = ask(gateway, conversation(topic, turn))
            assert [a - b for a, b in zip(served_by(replicas), before)].index(1) == first[topic]
            assert routed(gateway, request_id) == [(f"upstream{first[topic]}", "prefix")]
    pool = gateway.app.state.relay.pool  # each replica's pace was learned from its answers
    used = {c.upstream.base_url for c in pool.credentials if c.upstream.name in {f"upstream{i}" for i in first.values()}}
    assert set(pool.router.pace._mean) == used and all(m > 0 for m in pool.router.pace._mean.values())


# -- rule 3: otherwise the least loaded ---------------------------------------------------


def test_a_new_call_avoids_the_busy_replica(server_loop: ServerLoop, replicas: list[Simulator], tmp_path: Path,
                                            held: Held) -> None:
    two = replicas[:2]
    gateway = start(server_loop, tmp_path, two)
    held.hold(gateway, [{"role": "user", "content": "slow one"}])
    wait_for(lambda: sum(served_by(two)) == 1, timeout=10)
    busy = served_by(two).index(1)
    assert metric(gateway, "codebuddy2api_upstream_calls_in_flight", upstream=f"upstream{busy}") == 1
    # unrelated prompts, one after another, while the slow one is held in flight
    ids = [ask(gateway, conversation(topic, 1)) for topic in ("x", "y", "z")]
    assert served_by(two)[busy] == 1
    for request_id in ids:
        assert routed(gateway, request_id) == [(f"upstream{1 - busy}", "least_loaded")]


# -- rule 4: the imbalance gate moves the session ----------------------------------------


def test_the_imbalance_gate_moves_a_session_off_its_busy_replica(
    server_loop: ServerLoop, replicas: list[Simulator], tmp_path: Path, held: Held
) -> None:
    two = replicas[:2]
    gateway = start(server_loop, tmp_path, two, session_header="x-conversation",
                    routing_imbalance_rel=1.0, routing_imbalance_abs=1)
    session = {"x-conversation": "agent-7"}
    ask(gateway, conversation("agent-7", 1), headers=session)
    home = served_by(two).index(1)
    for n in (2, 3):  # two slow turns of the same session: within the gate (0 * 1.0 + 1 >= 1), then at it
        held.hold(gateway, conversation("agent-7", n), session)
        wait_for(lambda n=n: served_by(two)[home] == n, timeout=10)
    assert served_by(two) == ([3, 0] if home == 0 else [0, 3])
    moved = ask(gateway, conversation("agent-7", 4), headers=session)  # home holds 2 > 0 * 1.0 + 1
    stays = ask(gateway, conversation("agent-7", 5), headers=session)  # re-mapped: it stays there
    assert served_by(two)[home] == 3  # the slow ones still ran there meanwhile
    assert routed(gateway, moved) == [(f"upstream{1 - home}", "rebalanced")]
    assert routed(gateway, stays) == [(f"upstream{1 - home}", "session")]
    assert metric(gateway, "codebuddy2api_routing_decisions_total", reason="rebalanced") == 1


def test_named_sessions_leave_a_replica_that_slowed_down(server_loop: ServerLoop, replicas: list[Simulator],
                                                       tmp_path: Path) -> None:
    two = replicas[:2]
    gateway = start(server_loop, tmp_path, two, session_header="x-conversation")  # the default gate, slow factor 3
    agents = [f"agent-{n}" for n in range(4)]
    homes: dict[str, str] = {}
    for turn in (1, 2, 3):  # one call at a time: never more than one in flight, the gate never fires
        for agent in agents:
            homes[agent] = routed(gateway, ask(gateway, conversation(agent, turn), headers={"x-conversation": agent}))[0][0]
    # (new sessions spread in turn while both are idle and equally brisk; on a loaded machine
    # one replica's first answers can look slow, so the split is not asserted here)
    slow = homes["agent-0"]
    fast = "upstream1" if slow == "upstream0" else "upstream0"
    stuck = [a for a in agents if homes[a] == slow]
    slowed = two[int(slow[-1])]
    before = len(calls(slowed))
    # what the router learned of that replica's pace so far is forgotten: on a loaded machine
    # its brisk answers can already look 3x slower than the other's (the test servers'
    # noise), and its sessions would leave before the slowdown below
    pace = gateway.app.state.relay.pool.router.pace
    forgotten = [r for r in pace._mean if r.startswith(slowed.url)]
    assert forgotten  # it answered agent-0 at least
    for replica in forgotten:
        pace.forget(replica)
    # that replica now answers every call 6 s late (its engine slowed down; no error, nothing
    # in flight piles up): far past what a busy machine adds to the other's answers
    # (sessions the router moved during turns 1-3, when a loaded machine's noise made a
    # replica look slow, are counted apart: the moves below are the slowdown's)
    rebalanced_before = metric(gateway, "codebuddy2api_routing_decisions_total", reason="rebalanced")
    httpx.post(slowed.url + "/_sim/fault", json={"model": "text;chunk=7;ttfb=6"}).raise_for_status()
    trail: dict[str, list[tuple[str, str]]] = {a: [] for a in agents}
    for turn in range(4, 8):
        for agent in agents:
            trail[agent] += routed(gateway, ask(gateway, conversation(agent, turn), headers={"x-conversation": agent}))
    slow_answers = 0
    for agent in agents:
        if agent not in stuck:
            assert trail[agent] == [(fast, "session")] * 4
            continue
        # each session moves once and stays; it may move before its own first slow answer,
        # when another stuck session's slow answers already taught the router the pace
        there = trail[agent].index((fast, "rebalanced"))
        assert trail[agent][:there] == [(slow, "session")] * there, trail[agent]
        assert trail[agent][there + 1:] == [(fast, "session")] * (3 - there)
        slow_answers += there
    # slow answers teach the router the pace: a replica's pace counts from its third answer,
    # so at least that many went to the slowed one, and nothing else went there
    assert slow_answers >= PACE_MIN_SAMPLES, trail
    assert len(calls(slowed)) - before == slow_answers
    rebalanced = metric(gateway, "codebuddy2api_routing_decisions_total", reason="rebalanced") - rebalanced_before
    assert rebalanced == len(stuck)


def test_a_vllm_engines_own_queue_weighs_the_choice(server_loop: ServerLoop, replicas: list[Simulator],
                                                    tmp_path: Path) -> None:
    two = replicas[:2]
    gateway = start(server_loop, tmp_path, two, engine_api="vllm", session_header="x-conversation")
    home = routed(gateway, ask(gateway, conversation("agent-q", 1), headers={"x-conversation": "agent-q"}))[0][0]
    loaded = int(home[-1])
    router = gateway.app.state.relay.pool.router
    try:  # another client queues 12 requests on that engine, which its /metrics says
        httpx.post(two[loaded].url + "/_sim/engine_load", json={"waiting": 12, "kv_cache_usage": 0.9}).raise_for_status()
        wait_for(lambda: any(load.waiting == 12 for load, _ in router.reported.values()), timeout=15)
        moved = routed(gateway, ask(gateway, conversation("agent-q", 2), headers={"x-conversation": "agent-q"}))
        assert moved == [(f"upstream{1 - loaded}", "rebalanced")]  # 12 > 0 * 1.5 + 8
        fresh = [routed(gateway, ask(gateway, conversation(topic, 1)))[0] for topic in ("p", "q", "r")]
        assert fresh == [(f"upstream{1 - loaded}", "least_loaded")] * 3  # idle: 0 against 12, no turns
    finally:
        httpx.post(two[loaded].url + "/_sim/engine_load", json={"waiting": 0})


# -- rule 5: failover moves the session ----------------------------------------------------


def test_a_failed_replica_loses_its_session(server_loop: ServerLoop, replicas: list[Simulator],
                                            tmp_path: Path) -> None:
    three = replicas[:3]
    gateway = start(server_loop, tmp_path, three)
    rollout = f"{gateway.url}/rollouts/rl-42/v1"
    ask(gateway, conversation("rl-42", 1), rollout)
    home = served_by(three).index(1)
    httpx.post(three[home].url + "/_sim/fault", json={"model": "server_error"}).raise_for_status()
    failed_over = ask(gateway, conversation("rl-42", 2), rollout)  # the client sees one clean answer
    tried = attempts(gateway, failed_over)
    assert [(a["upstream"], a["status"], a["routing"]) for a in tried][0] == (f"upstream{home}", 500, "session")
    assert tried[1]["status"] == 200 and tried[1]["routing"] == "failover" and tried[1]["upstream"] != f"upstream{home}"
    httpx.delete(three[home].url + "/_sim/fault")  # healed: the session stays where it moved
    for turn in (3, 4):
        assert routed(gateway, ask(gateway, conversation("rl-42", turn), rollout)) == [(tried[1]["upstream"], "session")]
    assert metric(gateway, "codebuddy2api_routing_decisions_total", reason="failover") == 1
    assert metric(gateway, "codebuddy2api_routing_decisions_total", reason="session") == 3


# -- the session id upstream ---------------------------------------------------------------


def test_the_session_id_goes_upstream_only_when_asked(server_loop: ServerLoop, replicas: list[Simulator],
                                                      tmp_path: Path) -> None:
    one = replicas[:1]
    (tmp_path / "plain").mkdir()
    (tmp_path / "told").mkdir()
    plain = start(server_loop, tmp_path / "plain", one, session_header="x-conversation")
    ask(plain, conversation("c", 1), headers={"x-conversation": "conv-9"})
    assert not any(k in calls(one[0])[-1]["headers"] for k in ("x-session-id", "x-smg-routing-key"))
    told = start(server_loop, tmp_path / "told", one, session_header="x-conversation",
                 upstream_session_header="X-SMG-Routing-Key")
    ask(told, conversation("c", 1), headers={"x-conversation": "conv-9"})
    assert calls(one[0])[-1]["headers"]["x-smg-routing-key"] == "conv-9"
    ask(told, conversation("c", 1), f"{told.url}/rollouts/rollout.7/v1")
    assert calls(one[0])[-1]["headers"]["x-smg-routing-key"] == "rollout.7"
    ask(told, conversation("c", 1))  # no session: no header
    assert "x-smg-routing-key" not in calls(one[0])[-1]["headers"]
    answer = httpx.post(told.base_url + "/chat/completions", headers={"x-conversation": "café".encode("latin-1")},
                        json={"model": "text", "messages": conversation("c", 1)})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == TEXT
    assert "x-smg-routing-key" not in calls(one[0])[-1]["headers"]  # not ASCII: routed by it, not sent on


def test_an_upstream_session_header_that_is_no_header_name_is_refused(tmp_path: Path) -> None:
    from gateway.settings import SettingsError, load_settings

    with pytest.raises(SettingsError) as caught:
        load_settings({"upstream_session_header": "x session", "data_dir": tmp_path})
    assert "--upstream-session-header" in str(caught.value) and "header name" in str(caught.value)


def test_a_slow_factor_within_the_answers_spread_is_refused(tmp_path: Path) -> None:
    from gateway.settings import SettingsError, load_settings

    with pytest.raises(SettingsError) as caught:
        load_settings({"routing_slow_factor": 1.1, "data_dir": tmp_path})
    assert "--routing-slow-factor" in str(caught.value) and "0 (off) or at least 1.2" in str(caught.value)
    assert load_settings({"routing_slow_factor": 0, "data_dir": tmp_path})[0].routing_slow_factor == 0
    assert load_settings({"data_dir": tmp_path})[0].routing_slow_factor == 3.0


# -- round-robin keeps the behaviour before routing ----------------------------------------


def test_round_robin_spreads_the_same_prompt(server_loop: ServerLoop, replicas: list[Simulator],
                                             tmp_path: Path) -> None:
    gateway = start(server_loop, tmp_path, replicas[:2], routing="round-robin")
    ids = [ask(gateway, conversation("same", 2)) for _ in range(4)]
    assert served_by(replicas[:2]) == [2, 2]
    assert {routed(gateway, i)[0][1] for i in ids} == {"round_robin"}
    (tmp_path / "ca").mkdir()
    cache_aware = start(server_loop, tmp_path / "ca", replicas[2:])
    for _ in range(4):
        ask(cache_aware, conversation("same", 2))
    assert sorted(served_by(replicas[2:])) == [0, 4]
