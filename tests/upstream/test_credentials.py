"""Credential lifecycle end to end: an added credential is probed (its result in the answer
and the list), an added one can be deleted (for good: not back after a restart), an upstream
404 for a model fails over to a credential that serves it, a 401/403 naming the model keeps
the credential for its other models, and ``x-codebuddy2api-upstream`` names the upstream
that answered. Upstreams are small scripted servers on loopback."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.app import UPSTREAM_HEADER, create_app
from gateway.settings import Settings
from gateway.upstream.credential import Credential, Upstream
from gateway.upstream.failure_lessons import model_scoped_refusal
from gateway.upstream.pool import UpstreamPool
from tests.conftest import Gateway, ServerLoop

ADMIN_TOKEN = "admin-token-for-credential-tests-0123"
CLIENT_KEY = "client-key-for-credential-tests-456789"
GOOD_KEY = "sk-upstream-good-key-0123456789"
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Scripted:
    """A loopback OpenAI-compatible upstream: serves ``models``, answers 404 for the rest,
    403 naming the model for ``denied``, 401 for any key but ``key``."""

    name: str
    models: set[str]
    denied: set[str] = field(default_factory=set)
    key: str = GOOD_KEY
    calls: list[str] = field(default_factory=list)  # the model of each chat request
    url: str = ""

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = orjson.loads(await request.body())
            model = body["model"]
            self.calls.append(model)
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}, 401)
            if model in self.denied:
                return JSONResponse({"error": {"message": f"This key does not have access to model '{model}'",
                                               "type": "permission_error"}}, 403)
            if model not in self.models:
                return JSONResponse({"error": {"message": f"The model `{model}` does not exist", "type": "invalid_request_error"}}, 404)
            return StreamingResponse(self._sse(model), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse({"error": {"message": "Incorrect API key provided"}}, 401)
            return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in sorted(self.models)]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])

    async def _sse(self, model: str):  # type: ignore[no-untyped-def]
        base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1, "model": model}
        for chunk in (
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": f"from {self.name}"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
        ):
            yield b"data: " + orjson.dumps(base | chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"


def serve_scripted(server_loop: ServerLoop, upstream: Scripted) -> Scripted:
    upstream.url = server_loop.serve(upstream.app())
    return upstream


def start(server_loop: ServerLoop, data_dir: Path, **overrides: Any) -> Gateway:
    overrides.setdefault("spill_max_bytes", 1 << 20)
    settings = Settings(data_dir=data_dir, admin_token=ADMIN_TOKEN, api_key=[CLIENT_KEY], keepalive_interval=0.5, **overrides)
    app = create_app(settings, {name: "default" for name in Settings.model_fields})  # type: ignore[arg-type]
    return Gateway(server_loop.serve(app), app)


ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def add(gateway: Gateway, base_url: str, api_key: str | None, upstream: str) -> httpx.Response:
    return httpx.post(gateway.url + "/admin/api/credentials", headers=ADMIN,
                      json={"base_url": base_url, "api_key": api_key, "upstream": upstream}, timeout=20)


def delete(gateway: Gateway, credential_id: str) -> httpx.Response:
    return httpx.request("DELETE", f"{gateway.url}/admin/api/credentials/{credential_id}", headers=ADMIN, json={})


def listed(gateway: Gateway) -> dict[str, dict[str, Any]]:
    answer = httpx.get(gateway.url + "/admin/api/credentials", headers=ADMIN)
    assert answer.status_code == 200
    return {c["upstream"]: c for c in answer.json()["credentials"]}


def stream(gateway: Gateway, model: str) -> tuple[str, str | None]:
    """The assembled answer text (the SDK's stream helper, strict) and the upstream header."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key=CLIENT_KEY, _strict_response_validation=True, max_retries=0)
    with client.chat.completions.stream(model=model, messages=MESSAGES) as events:
        header = events._raw_stream.response.headers.get(UPSTREAM_HEADER)  # the HTTP response under the helper
        return events.get_final_completion().choices[0].message.content or "", header


def test_an_added_credential_is_probed_and_the_result_shown(server_loop: ServerLoop, tmp_path: Path) -> None:
    a = serve_scripted(server_loop, Scripted("a", {"alpha"}))
    b = serve_scripted(server_loop, Scripted("b", {"alpha"}))
    gateway = start(server_loop, tmp_path, upstream_url=[a.url + "/v1"], upstream_api_key=GOOD_KEY)
    good = add(gateway, b.url + "/v1", GOOD_KEY, "b")
    assert good.status_code == 201, good.text
    assert good.json()["probe"] == {"ok": True, "result": "HTTP 200", "status": 200, "hint": None}
    assert good.json()["last_probe_result"] == "HTTP 200" and good.json()["disabled"] is False
    assert GOOD_KEY not in good.text
    refused = add(gateway, b.url + "/v1", "sk-revoked-key-0123456789abc", "b-revoked")
    assert refused.status_code == 201
    assert refused.json()["probe"]["status"] == 401 and refused.json()["probe"]["ok"] is False
    assert refused.json()["disabled"] is True and refused.json()["disabled_by"] == "upstream"  # probed again later
    no_v1 = add(gateway, b.url, GOOD_KEY, "b-no-v1")
    # the one URL check (gateway/upstream/urls.py) refuses it before any probe goes out
    assert no_v1.status_code == 400 and no_v1.json()["error"]["code"] == "invalid_upstream_url"
    unreachable = add(gateway, "http://127.0.0.1:9/v1", GOOD_KEY, "nowhere")
    assert unreachable.json()["probe"]["ok"] is False and unreachable.json()["probe"]["status"] is None
    shown = listed(gateway)
    assert shown["b"]["last_probe_result"] == "HTTP 200" and shown["b-revoked"]["last_probe_result"] == "HTTP 401"
    # the refused key serves nothing: every request goes to the working ones
    for _ in range(4):
        assert stream(gateway, "alpha")[0] in ("from a", "from b")


def test_deleting_an_added_credential_is_for_good(server_loop: ServerLoop, tmp_path: Path) -> None:
    a = serve_scripted(server_loop, Scripted("a", {"alpha"}))
    b = serve_scripted(server_loop, Scripted("b", {"alpha"}))
    gateway = start(server_loop, tmp_path, upstream_url=[a.url + "/v1"], upstream_api_key=GOOD_KEY)
    added = add(gateway, b.url + "/v1", GOOD_KEY, "b").json()
    assert set(listed(gateway)) == {"upstream", "b"}
    configured = listed(gateway)["upstream"]
    assert configured["added_by_admin"] is False and added["added_by_admin"] is True
    refused = delete(gateway, configured["id"])
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "credential_configured"
    gone = delete(gateway, added["id"])
    assert gone.status_code == 200 and gone.json()["deleted"] == added["id"]
    assert set(listed(gateway)) == {"upstream"}
    missing = delete(gateway, added["id"])
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "credential_not_found"
    b.calls.clear()
    for _ in range(3):
        assert stream(gateway, "alpha")[0] == "from a"
    assert b.calls == []
    restarted = start(server_loop, tmp_path, upstream_url=[a.url + "/v1"], upstream_api_key=GOOD_KEY)
    assert set(listed(restarted)) == {"upstream"}  # not back from the store
    again = add(restarted, b.url + "/v1", GOOD_KEY, "b")
    assert again.status_code == 201 and again.json()["id"] == added["id"]  # and may be added again


def test_an_upstream_404_for_a_model_fails_over_to_one_that_serves_it(server_loop: ServerLoop, tmp_path: Path) -> None:
    a = serve_scripted(server_loop, Scripted("a", {"alpha"}))
    b = serve_scripted(server_loop, Scripted("b", {"alpha", "beta"}))
    # round-robin: the same prompt reaches both upstreams (cache-aware would keep it on one)
    gateway = start(server_loop, tmp_path, upstream_url=[a.url + "/v1", b.url + "/v1"], upstream_api_key=GOOD_KEY,
                    routing="round-robin")
    for _ in range(4):
        assert stream(gateway, "beta")[0] == "from b"
    assert a.calls.count("beta") == 1  # asked once; then passed over for beta
    shown = listed(gateway)
    assert shown["upstream0"]["disabled"] is False
    assert shown["upstream0"]["unavailable_models"]["beta"]["reason"] == "upstream answered 404"
    answers = {stream(gateway, "alpha")[0] for _ in range(4)}
    assert answers == {"from a", "from b"}  # a still serves its other models
    # a model nobody serves: the upstream's 404, in the client's error shape
    client = openai.OpenAI(base_url=gateway.base_url, api_key=CLIENT_KEY, _strict_response_validation=True, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gamma", messages=MESSAGES)  # type: ignore[arg-type]
    assert caught.value.body["code"] == "upstream_not_found"  # type: ignore[index]
    assert a.calls.count("gamma") == 1 and b.calls.count("gamma") == 1


def test_a_refusal_naming_the_model_keeps_the_credential_for_other_models(server_loop: ServerLoop, tmp_path: Path) -> None:
    a = serve_scripted(server_loop, Scripted("a", {"alpha", "beta"}, denied={"beta"}))
    b = serve_scripted(server_loop, Scripted("b", {"alpha", "beta"}))
    # round-robin: the same prompt reaches both upstreams (cache-aware would keep it on one)
    gateway = start(server_loop, tmp_path, upstream_url=[a.url + "/v1", b.url + "/v1"], upstream_api_key=GOOD_KEY,
                    routing="round-robin")
    for _ in range(3):
        assert stream(gateway, "beta")[0] == "from b"
    shown = listed(gateway)["upstream0"]
    assert shown["disabled"] is False and shown["unavailable_models"]["beta"]["reason"] == "upstream answered 403"
    assert {stream(gateway, "alpha")[0] for _ in range(4)} == {"from a", "from b"}
    # a 401 about the key itself takes the credential out for every model
    a.key = "sk-rotated-upstream-key-987654321"
    answers = [stream(gateway, "alpha")[0] for _ in range(4)]
    assert answers == ["from b"] * 4
    shown = listed(gateway)["upstream0"]
    assert shown["disabled"] is True and shown["disabled_by"] == "upstream" and shown["disabled_reason"] == "upstream answered 401"


def test_the_upstream_header_names_the_upstream_that_answered(server_loop: ServerLoop, tmp_path: Path) -> None:
    real = serve_scripted(server_loop, Scripted("real", {"text"}))
    gateway = start(server_loop, tmp_path, simulator=True, routing="round-robin")  # the same prompt reaches both
    assert add(gateway, real.url + "/v1", GOOD_KEY, "real-upstream").status_code == 201
    seen: dict[str, str] = {}
    for _ in range(6):
        text, header = stream(gateway, "text")
        assert header is not None
        seen[header] = text
    assert set(seen) == {"simulator", "real-upstream"}
    assert seen["real-upstream"] == "from real"
    assert seen["simulator"].startswith("Hello from the codebuddy2api simulator")
    assert httpx.get(gateway.url + "/healthz").headers[UPSTREAM_HEADER] == "simulator"
    json_answer = httpx.post(gateway.base_url + "/chat/completions", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                             json={"model": "text", "messages": MESSAGES})
    expected = "from real" if json_answer.headers[UPSTREAM_HEADER] == "real-upstream" else "Hello from"
    assert json_answer.json()["choices"][0]["message"]["content"].startswith(expected)


# -- the pool's part, unit -----------------------------------------------------------------


def test_model_scoped_refusal_reads_the_message() -> None:
    assert model_scoped_refusal("This key does not have access to model 'gpt-4o'", "gpt-4o", "gpt-4o")
    assert model_scoped_refusal("Permission denied for models/gemini-2.5-pro", "gemini", "gemini-2.5-pro")
    assert model_scoped_refusal("the model is not allowed for this project", "m", "m")
    assert not model_scoped_refusal("Incorrect API key provided", "gpt-4o", "gpt-4o")
    assert not model_scoped_refusal("invalid x-api-key", "m", "m")
    assert not model_scoped_refusal(None, "m", "m")


def test_a_credential_deleted_on_another_replica_leaves_this_pool() -> None:
    now = [1000.0]
    upstream = Upstream("added", "http://127.0.0.1:9/v1")
    configured = Credential(Upstream("configured", "http://127.0.0.1:8/v1"), None)
    old = Credential(upstream, "sk-old", added_by_admin=True, added_at=900.0)
    fresh = Credential(upstream, "sk-fresh", added_by_admin=True, added_at=995.0)
    pool = UpstreamPool([configured, old, fresh], clock=lambda: now[0])
    pool.apply_shared({}, [])  # the store has no added rows: deleted elsewhere
    assert [c.id for c in pool.credentials] == [configured.id, fresh.id]  # fresh: its row may not be read yet
    now[0] = 1100.0
    pool.apply_shared({}, [])
    assert [c.id for c in pool.credentials] == [configured.id]
    pool.apply_shared({}, [(old.id, "added", upstream.base_url, "sk-old")])
    assert [c.id for c in pool.credentials] == [configured.id, old.id]  # added on another replica
    pool.remove(old.id)
    pool.apply_shared({}, [(old.id, "added", upstream.base_url, "sk-old")])  # a poll from before the delete
    assert [c.id for c in pool.credentials] == [configured.id]
    with pytest.raises(ValueError):
        pool.remove(configured.id)
    with pytest.raises(KeyError):
        pool.remove("nope")


# -- the store's part, on SQLite and PostgreSQL ----------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    from gateway.store.db import open_database

    url = request.getfixturevalue("postgres_schema") if request.param == "postgres" else None
    db = open_database(url, tmp_path)
    yield db
    db.close()


async def test_audit_filters_by_upstream_exactly_on_the_record(store: Any) -> None:
    """``?upstream=`` matches any attempt's upstream name, exactly: LIKE's wildcards in a
    name are literal, and a name that is a prefix of another does not match it."""
    import time

    from gateway.generation.record import RequestRecord
    from gateway.store import audit_queries
    from gateway.store.audit import AuditWriter

    writer = AuditWriter(store, flush_interval=0.01)
    await writer.start()
    names = {"r1": ["a"], "r2": ["a_b"], "r3": ["a%b"], "r4": ["x", "a"], "r5": [], "r6": ['q"uote']}
    for request_id, upstreams in names.items():
        writer.submit(RequestRecord(request_id=request_id, protocol="chat", started_at=time.time(), model="m",
                                    upstream_attempts=[{"upstream": u, "status": 200} for u in upstreams]))
    await writer.aclose()
    assert writer.written == len(names)

    async def ids(name: str) -> set[str]:
        rows, total = await audit_queries.query(store, upstream=name)
        assert total == len(rows)
        return {r["request_id"] for r in rows}

    assert await ids("a") == {"r1", "r4"}
    assert await ids("a_b") == {"r2"}
    assert await ids("a%b") == {"r3"}
    assert await ids("x") == {"r4"}
    assert await ids('q"uote') == {"r6"}
    assert await ids("nobody") == set()


def test_a_deleted_credential_is_gone_from_the_store(store: Any) -> None:
    from gateway.store.credentials import CredentialState

    state = CredentialState(store)
    state.add_credential("fp_1@added", "added", "http://127.0.0.1:9/v1", "sk-stored-key-0123456789")
    state.add_credential("fp_2@kept", "kept", "http://127.0.0.1:9/v1", None)
    state.save("fp_1@added", {"disabled": True})
    state.delete_credential("fp_1@added")
    assert [row[0] for row in state.added_credentials()] == ["fp_2@kept"]
    assert "fp_1@added" not in state.load()
