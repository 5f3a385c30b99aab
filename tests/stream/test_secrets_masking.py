"""Secrets masked where byte masks cannot see them: split across two (or more) deltas in a
stream (every client surface, through the official SDK stream helpers in strict mode),
and the secrets an upstream's config carries (header values, URL userinfo)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from gateway.redact import MASK, SecretSet
from gateway.stream.events import BlockDelta, BlockStart, BlockStop, Finish
from gateway.stream.masking import DeltaMasker
from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway
from tests.drivers import drive_chat, drive_messages

SECRET = "sk-split-secret-0123456789abcdef"  # the upstream key: in the masked set
OTHER = "ck-another-secret-abcdefghijkl"  # a second secret sharing no prefix with SECRET
OFFSETS = range(1, len(SECRET))
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


# -- the pure class -------------------------------------------------------------------------


def _masker(*secrets: str) -> DeltaMasker:
    held = SecretSet()
    held.set("test", secrets)
    return DeltaMasker(held)


def _assembled(events: list[Any]) -> tuple[str, str]:
    """(the deltas joined, the BlockStop content) of block 0."""
    deltas = "".join(e.text for e in events if isinstance(e, BlockDelta) and e.index == 0)
    [stop] = [e for e in events if isinstance(e, BlockStop) and e.index == 0]
    return deltas, stop.content


@pytest.mark.parametrize("kind", ["text", "reasoning", "tool"])
def test_a_secret_split_at_any_offset_is_masked_in_the_deltas_and_the_content(kind: str) -> None:
    for cut in OFFSETS:
        masker = _masker(SECRET, OTHER)
        first, second = f"before {SECRET[:cut]}", f"{SECRET[cut:]} after"
        events = masker.feed([BlockStart(0, kind)])  # type: ignore[arg-type]
        events += masker.feed([BlockDelta(0, kind, first)])  # type: ignore[arg-type]
        events += masker.feed([BlockDelta(0, kind, second)])  # type: ignore[arg-type]
        events += masker.feed([BlockStop(0, kind, first + second), Finish("stop", None)])  # type: ignore[arg-type]
        deltas, content = _assembled(events)
        assert deltas == content == f"before {MASK} after", cut
        assert not any(SECRET[:cut] in e.text and cut > 3 for e in events if isinstance(e, BlockDelta)), cut
        assert isinstance(events[-1], Finish)


def test_a_secret_in_three_pieces_and_one_delta_per_character() -> None:
    masker = _masker(SECRET)
    pieces = [SECRET[:5], SECRET[5:12], SECRET[12:]]
    events = [e for p in pieces[:2] for e in masker.feed([BlockDelta(0, "text", p)])]
    assert events == []  # all of it could still be the secret: held
    assert masker.feed([BlockDelta(0, "text", pieces[2])]) == [BlockDelta(0, "text", MASK)]  # whole: masked, out
    assert masker.feed([BlockDelta(0, "text", "!")]) == [BlockDelta(0, "text", "!")]
    per_char = _masker(SECRET)
    out = [e for c in f"x{SECRET}y" for e in per_char.feed([BlockDelta(0, "text", c)])]
    out += per_char.feed([BlockStop(0, "text", f"x{SECRET}y")])
    assert _assembled(out) == (f"x{MASK}y", f"x{MASK}y")


def test_a_held_tail_that_is_no_secret_comes_out_whole_and_in_order() -> None:
    """Held only while it could start a secret; released with the next delta, or at the
    block's end; other blocks' events are not held with it."""
    masker = _masker(SECRET)
    assert masker.feed([BlockDelta(0, "text", "a sk-spl")]) == [BlockDelta(0, "text", "a ")]
    assert masker.feed([BlockDelta(1, "tool", '{"a": 1')]) == [BlockDelta(1, "tool", '{"a": 1')]
    assert masker.feed([BlockDelta(0, "text", "endid")]) == [BlockDelta(0, "text", "sk-splendid")]
    assert masker.feed([BlockDelta(0, "text", " sk")]) == [BlockDelta(0, "text", " ")]
    assert masker.feed([BlockStop(0, "text", "a sk-splendid sk")]) == [
        BlockDelta(0, "text", "sk"), BlockStop(0, "text", "a sk-splendid sk")]
    plain = BlockDelta(0, "text", "nothing secret here")
    assert masker.feed([plain])[0] is plain  # no copy when nothing changed


def test_the_held_tail_is_at_most_the_longest_secret_less_one() -> None:
    held = SecretSet()
    held.set("t", [SECRET, "short-secret-1"])
    assert held.held_tail("xx" + SECRET[:-1]) == len(SECRET) - 1
    assert held.held_tail("sk-split") == len("sk-split") and held.held_tail("short-") == len("short-")
    assert held.held_tail("no secret starts here.") == 0 and held.held_tail("") == 0
    assert SecretSet().held_tail("sk-split") == 0  # nothing configured: nothing held


# -- the running app, every surface ----------------------------------------------------------


@pytest.fixture(scope="module")
def realtime(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, stream_mode="realtime", upstream_api_key=SECRET)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _split(field: str, first: str, second: str, then: str | None = None) -> list[dict[str, Any]]:
    frames = [_chunk({"role": "assistant", field: first}), _chunk({field: second})]
    if then is not None:
        frames.append(_chunk({"content": then}))
    return [*frames, _chunk({}, "stop"), USAGE, {"_op": "done"}]


def _tool_split(first: str, second: str) -> list[dict[str, Any]]:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": first}}
    return [_chunk({"role": "assistant", "tool_calls": [call]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": second}}]}),
            _chunk({}, "tool_calls"), USAGE, {"_op": "done"}]


def _responses_text(gateway: Gateway, model: str) -> tuple[str, str]:
    """(the output_text deltas joined, the final response's output_text), strict SDK."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    deltas: list[str] = []
    with client.responses.stream(model=model, input="go", timeout=30) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    return "".join(deltas), final.output_text


SURFACES = ["chat_content", "chat_reasoning", "chat_tool_arguments", "messages", "responses"]


@pytest.mark.parametrize("surface", SURFACES)
def test_a_secret_split_across_deltas_is_masked_on_every_surface(realtime: Gateway, simulator: Simulator, surface: str) -> None:
    """The upstream splits a configured secret across two deltas, at every offset: the
    client's SDK assembles the mask, never the secret (nor its halves joined)."""
    for cut in OFFSETS:
        first, second = f"before {SECRET[:cut]}", f"{SECRET[cut:]} after"
        if surface == "chat_tool_arguments":
            model = simulator.script(_tool_split('{"city": "' + first, second + '"}'))
            outcome = drive_chat(realtime.url, model)
            assert outcome.ok and outcome.tools == [("get_weather", {"city": f"before {MASK} after"})], (cut, outcome)
            continue
        if surface == "chat_reasoning":
            model = simulator.script(_split("reasoning_content", first, second, then="ok"))
            outcome = drive_chat(realtime.url, model)
            assert outcome.ok and outcome.reasoning == f"before {MASK} after" and outcome.text == "ok", (cut, outcome)
            continue
        model = simulator.script(_split("content", first, second))
        if surface == "responses":
            deltas, final = _responses_text(realtime, model)
            assert deltas == final == f"before {MASK} after", cut
            continue
        outcome = (drive_chat if surface == "chat_content" else drive_messages)(realtime.url, model)
        assert outcome.ok and outcome.text == f"before {MASK} after", (cut, outcome)


def test_split_secrets_leave_raw_bytes_clean_too(realtime: Gateway, simulator: Simulator) -> None:
    """The wire itself (no SDK joining): neither half of the secret near its cut, on
    Messages' raw SSE, for a three-way split."""
    pieces = [SECRET[:9], SECRET[9:20], SECRET[20:]]
    frames = [_chunk({"role": "assistant", "content": "a " + pieces[0]}), _chunk({"content": pieces[1]}),
              _chunk({"content": pieces[2] + " b"}), _chunk({}, "stop"), USAGE, {"_op": "done"}]
    model = simulator.script(frames)
    body = {"model": model, "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    raw = httpx.post(realtime.base_url + "/messages", json=body, timeout=30).text
    assert all(piece not in raw for piece in pieces) and MASK in raw


# -- secrets an upstream's config carries --------------------------------------------------


HEADER_VALUE = "azure-style-api-key-0123456789"
URL_PASSWORD = "url-password-0123456789abc"
URL_USER = "url-user-name-0123456789"


@pytest.fixture(scope="module")
def configured(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    config = tmp_path_factory.mktemp("config") / "upstreams.toml"
    url = simulator.url.replace("http://", f"http://{URL_USER}:{URL_PASSWORD}@") + "/v1"
    config.write_text(f'[[upstreams]]\nname = "azure"\nbase_url = "{url}"\n'
                      f'headers = {{ "api-key" = "{HEADER_VALUE}", "api-version" = "2024-10-21" }}\n')
    return start_gateway(server_loop, simulator, tmp_path_factory, upstream_url=[], config=config)


@pytest.mark.parametrize("stream", [False, True])
def test_config_header_values_and_url_userinfo_are_masked_in_client_bytes(
    configured: Gateway, simulator: Simulator, stream: bool
) -> None:
    text = f"h={HEADER_VALUE} p={URL_PASSWORD} u={URL_USER} v=2024-10-21"
    model = simulator.script([_chunk({"role": "assistant", "content": text}), _chunk({}, "stop"), USAGE, {"_op": "done"}])
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "go"}]}
    raw = httpx.post(configured.base_url + "/chat/completions", json=body, timeout=30).text
    for secret in (HEADER_VALUE, URL_PASSWORD, URL_USER):
        assert secret not in raw
    if stream:  # the deltas joined (a tail that could begin some secret comes in a delta of its own)
        chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    else:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    assert content == f"h={MASK} p={MASK} u={MASK} v=2024-10-21"


def test_the_credentials_listing_shows_urls_without_userinfo(configured: Gateway, simulator: Simulator) -> None:
    listed = httpx.get(configured.url + "/admin/api/credentials", headers=configured.admin)
    assert listed.status_code == 200
    [credential] = listed.json()["credentials"]
    assert credential["base_url"] == simulator.url + "/v1"
    for secret in (URL_PASSWORD, URL_USER, HEADER_VALUE):
        assert secret not in listed.text


def test_a_password_in_an_admin_added_url_is_masked_and_never_listed(configured: Gateway) -> None:
    secret = "added-url-password-000111222"
    added = httpx.post(configured.url + "/admin/api/credentials", headers=configured.admin,
                       json={"base_url": f"http://someone:{secret}@127.0.0.1:9/v1", "upstream": "late-userinfo"})
    assert added.status_code == 201 and secret not in added.text
    assert added.json()["base_url"] == "http://127.0.0.1:9/v1"
    pool = configured.app.state.relay.pool
    pool.disable(added.json()["id"])  # port 9: never picked
    listed = httpx.get(configured.url + "/admin/api/credentials", headers=configured.admin).text
    assert secret not in listed and "someone" not in listed
    from gateway.redact import SECRETS

    assert SECRETS.mask(f"<{secret}>") == f"<{MASK}>"


def test_masking_tool_arguments_never_breaks_the_strict_anthropic_parse(realtime: Gateway, simulator: Simulator) -> None:
    """Messages' input_json_delta is re-parsed by the anthropic SDK after every fragment:
    held tails keep every released prefix a valid partial object."""
    for cut in (1, 8, len(SECRET) - 1):
        model = simulator.script(_tool_split('{"city": "x ' + SECRET[:cut], SECRET[cut:] + '"}'))
        outcome = drive_messages(realtime.url, model)
        assert outcome.ok and outcome.tools == [("get_weather", {"city": f"x {MASK}"})], (cut, outcome)


def test_compatible_mode_masks_a_secret_split_by_the_replay_pieces(
    server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Compatible mode replays long text in 16 KiB deltas: a secret on a piece boundary
    is masked too (the same masker sits before the encoders in both modes)."""
    from gateway.stream.compatible import REPLAY_PIECE_CHARS

    gateway = start_gateway(server_loop, simulator, tmp_path_factory, upstream_api_key=SECRET)
    text = "x" * (REPLAY_PIECE_CHARS - 5) + SECRET + " end"
    model = simulator.script([_chunk({"role": "assistant", "content": text}), _chunk({}, "stop"), USAGE, {"_op": "done"}])
    outcome = drive_chat(gateway.url, model)
    assert outcome.ok and outcome.text == "x" * (REPLAY_PIECE_CHARS - 5) + MASK + " end"


def test_a_secret_added_mid_stream_is_masked_from_then_on() -> None:
    """The masker reads the live set at each delta: a secret added while a stream runs (a
    credential added at run time) is masked from its next delta on."""
    held = SecretSet()
    masker = DeltaMasker(held)
    assert masker.feed([BlockDelta(0, "text", OTHER)]) == [BlockDelta(0, "text", OTHER)]
    held.set("late", [OTHER])
    assert masker.feed([BlockDelta(0, "text", OTHER + ".")]) == [BlockDelta(0, "text", MASK + ".")]


def test_a_key_longer_than_the_trie_is_held_at_every_offset_too() -> None:
    """An OpenAI project key is ~164 characters and a database URL may be longer: the
    prefix trie stops at TRIE_DEPTH (re compiles nesting recursively), the rest is found
    by a scan for the key's first character; a set holding such a key compiles at all."""
    from gateway.redact import TRIE_DEPTH

    long_key = "sk-proj-" + "Ab3x" * 100  # 408 characters
    assert len(long_key) > TRIE_DEPTH * 2
    for cut in range(1, len(long_key), 7):
        masker = _masker(long_key, SECRET)
        out = masker.feed([BlockDelta(0, "text", "x " + long_key[:cut])]) + masker.feed(
            [BlockDelta(0, "text", long_key[cut:] + " y")]) + masker.feed([BlockStop(0, "text", "")])
        assert "".join(e.text for e in out if isinstance(e, BlockDelta)) == f"x {MASK} y", cut
