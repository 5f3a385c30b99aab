"""From first run to production: the banner, every start-up refusal (one line, exit 2),
the ``--config`` model with the example file, JSON bodies for unknown routes and methods,
``GET /v1/models/{id}`` and the simulator's response header."""

from __future__ import annotations

import io
import json
import os
import pty
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import SecretStr

from gateway import __version__
from gateway.app import UPSTREAM_HEADER, create_app
from gateway.banner import print_banner, render_text, startup_facts
from gateway.settings import Settings, SettingsError, base_url_hint
from gateway.upstream.config_file import ConfigFile, UpstreamEntry, load_config_file
from gateway.upstream.credential import Upstream
from tests.conftest import Gateway, ServerLoop
from tests.processes import free_port, readable, wait_healthy

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = REPO / "examples" / "config.toml"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")}
    return {**env, **extra}


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=30,
        env=env or clean_env(), cwd=cwd,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str]) -> str:
    """The refusal's only line (exit 2, no traceback, nothing on stdout)."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert lines[0].startswith("codebuddy2api: error: ")
    return lines[0]


# -- the banner ---------------------------------------------------------------------------


def test_banner_names_version_urls_mode_upstreams_store_and_auth(tmp_path: Path) -> None:
    settings = Settings(
        host="0.0.0.0", port=9000, upstream_url=["http://gpu-1:8000/v1"], api_key=[SecretStr("client-secret-key-0001")],
        admin_token=SecretStr("admin-secret-token-0001"), stream_mode="realtime", data_dir=tmp_path,
        database_url=SecretStr("postgresql://app:pg-password@db.internal:5433/gw"),
    )
    upstreams = [Upstream("upstream", "http://gpu-1:8000/v1"), Upstream("mapped", "https://user:pw@api.example.com/v1", model_map={"qwen": "Qwen/Qwen2.5"})]
    facts = startup_facts(settings, upstreams, None, webui=True)
    text = render_text(facts)
    assert text.startswith(f"codebuddy2api {__version__}\n")
    for expected in ("http://0.0.0.0:9000", "http://0.0.0.0:9000/ui/", "realtime", "gpu-1:8000/v1",
                     "api.example.com/v1", "qwen -> Qwen/Qwen2.5", "PostgreSQL db.internal:5433/gw",
                     "1 client key(s) required", "admin token required"):
        assert expected in text, expected
    assert "SIMULATOR" not in text and not facts["simulator"]
    for secret in ("client-secret-key-0001", "admin-secret-token-0001", "pg-password", "user:pw"):
        assert secret not in text and secret not in json.dumps(facts)


def test_banner_says_simulator_in_capitals_and_warns() -> None:
    facts = startup_facts(Settings(), [Upstream("simulator", "http://127.0.0.1:1/v1")], "http://127.0.0.1:1/v1", webui=False)
    text = render_text(facts)
    assert "upstream     SIMULATOR" in text or "SIMULATOR (built-in" in text
    assert facts["simulator"] is True and facts["upstreams"] == []
    assert any("SIMULATOR" in hint for hint in facts["hints"])
    assert "WebUI" in text and "not installed" in text
    assert "no client key (loopback bind only)" in text and "admin token generated for this run" in text


def test_banner_is_one_json_event_off_a_terminal_and_text_on_one() -> None:
    facts = startup_facts(Settings(upstream_url=["http://h:1"]), [Upstream("upstream", "http://h:1")], None, webui=True)
    out = io.StringIO()
    print_banner(facts, out, tty=False)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "startup" and event["version"] == __version__
    assert event["upstreams"][0]["host"] == "h:1"
    assert event["hints"] == ["http://h:1 does not end in /v1: requests go to http://h:1/chat/completions (is that right?)"]
    out = io.StringIO()
    print_banner(facts, out, tty=True)
    assert out.getvalue() == render_text(facts)


def test_base_url_hint_only_without_v1() -> None:
    assert base_url_hint("http://h:8000/v1") is None and base_url_hint("http://h:8000/v1/") is None
    assert "does not end in /v1" in (base_url_hint("http://h:8000/api") or "")


def test_serve_prints_the_banner_at_warning_level_and_marks_simulator_answers(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", str(tmp_path), "--log-level", "warning"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", _strict_response_validation=True)
        raw = client.chat.completions.with_raw_response.create(model="text", messages=[{"role": "user", "content": "hi"}])
        assert raw.headers[UPSTREAM_HEADER] == "simulator"
        assert raw.parse().choices[0].message.content.startswith("Hello from the codebuddy2api simulator")
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    startup = [e for e in events if e.get("event") == "startup"]
    assert len(startup) == 1, stderr
    banner = startup[0]
    assert banner["simulator"] is True and banner["listen_url"] == f"http://127.0.0.1:{port}"
    assert banner["webui_url"] == f"http://127.0.0.1:{port}/ui/" and banner["stream_mode"] == "compatible"
    assert banner["store"] == f"SQLite {tmp_path / 'codebuddy2api.sqlite3'}"
    # no --admin-token: the one-time login URL is in its 0600 file, and nowhere on stderr
    token = Path(banner["admin_login_file"]).read_text().strip().removeprefix(f"http://127.0.0.1:{port}/ui/?token=")
    assert token and "/" not in token and stderr.count(token) == 0 and banner["admin_token_prefix"] == token[:6] + "..."
    assert [e for e in events if e.get("level") == "info" and e.get("event") != "startup"] == []


def test_simulator_uvicorn_lines_are_labelled(tmp_path: Path) -> None:
    """Two uvicorn servers in one process: the simulator's lines carry component=simulator,
    and only the gateway says it started."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--simulator", "--port", str(port), "--data-dir", str(tmp_path)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "text", "messages": [{"role": "user", "content": "x"}]})
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    started = [e for e in events if str(e.get("event", "")).startswith(("Started server process", "Uvicorn running on"))]
    assert [e.get("component") for e in started] == [None, None]  # the simulator's own start lines are dropped
    assert f"127.0.0.1:{port}" in started[1]["event"]
    access = [e for e in events if e.get("event") == "http"]
    simulator_paths = {e["path"] for e in access if e.get("component") == "simulator"}
    gateway_paths = {e["path"] for e in access if "component" not in e}
    assert simulator_paths == {"/v1/chat/completions"} and "/v1/chat/completions" in gateway_paths


def test_banner_is_plain_text_on_a_terminal(tmp_path: Path) -> None:
    port = free_port()
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--simulator", "--port", str(port), "--data-dir", str(tmp_path), "--log-level", "error"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=follower, text=True,
    )
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"  hint " not in seen and time.monotonic() < deadline:  # the last row
            if readable(leader, 0.5):
                seen += os.read(leader, 4096)
    finally:
        proc.terminate()
        proc.wait(15)
        os.close(leader)
    text = seen.decode()
    assert text.startswith(f"codebuddy2api {__version__}"), text
    assert "SIMULATOR" in text and f"http://127.0.0.1:{port}/ui/" in text and "{" not in text


# -- refusals: one line, exit status 2 ----------------------------------------------------


def test_non_loopback_bind_without_upstream_is_refused() -> None:
    line = one_line_refusal(run_cli("serve", "--host", "0.0.0.0", "--api-key", "a-client-key-of-24-chars", "--port", "1"))
    assert "no upstream configured" in line and "--upstream-url" in line and "--simulator" in line


def test_upstream_key_without_url_is_refused() -> None:
    line = one_line_refusal(run_cli("serve", "--upstream-api-key", "sk-secret-value"))
    assert "--upstream-api-key" in line and "--upstream-url" in line and "sk-secret-value" not in line


def test_simulator_with_an_upstream_is_refused() -> None:
    line = one_line_refusal(run_cli("serve", "--simulator", "--upstream-url", "http://h:1/v1"))
    assert "--simulator" in line and "exclude" in line


@pytest.mark.parametrize("url", ["my-vllm:8000", "ftp://h/v1", "http:///v1", "http://h:99999/v1"])
def test_bad_upstream_url_is_refused(url: str) -> None:
    line = one_line_refusal(run_cli("serve", "--upstream-url", url))
    assert "--upstream-url" in line and url in line


def test_bad_upstream_url_from_the_environment_names_the_variable() -> None:
    line = one_line_refusal(run_cli("serve", env=clean_env(CODEBUDDY2API_UPSTREAM_URL="my-vllm:8000")))
    assert "CODEBUDDY2API_UPSTREAM_URL" in line


def test_address_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line_refusal(run_cli("serve", "--simulator", "--port", str(port), "--data-dir", str(tmp_path)))
    assert f"127.0.0.1:{port}" in line and "already in use" in line


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[[upstreams]]\nname = 'a'\nbase_url = 'http://h:1/v1'\nmodel_maps = {a = 'b'}\n",
         ":4: upstreams[0].model_maps: unknown key (allowed: name, base_url,"),
        ("# a comment\n[[upstreams]]\nname = 'a'\n\n[[upstreams]]\nname = 'b'\n",
         ":2: upstreams[0].base_url: Field required"),
        ("[[upstreams]]\nbase_url = 'http://h:1/v1'\n[[upstreams]]\nbase_url = 'vllm:8000'\n",
         ":4: upstreams[1].base_url: 'vllm:8000' is not an http:// or https:// URL"),
        ("upstream = []\n", ":1: upstream: unknown key (allowed: upstreams, models)"),
        ("[[upstreams]]\nbase_url = 'http://h:1/v1'\nheaders = {x = 1}\n", ":3: upstreams[0].headers.x: Input should be a valid string"),
        ("[[upstreams]\nbase_url = 1\n", ": not valid TOML: "),
        ("upstreams = []\n", ": no [[upstreams]] table"),
    ],
)
def test_config_errors_are_one_line_naming_file_key_and_line(tmp_path: Path, text: str, expected: str) -> None:
    config = tmp_path / "gw.toml"
    config.write_text(text)
    line = one_line_refusal(run_cli("serve", "--config", str(config)))
    assert f"--config {config}{expected}" in line, line


def test_missing_config_file_is_one_line(tmp_path: Path) -> None:
    line = one_line_refusal(run_cli("serve", "--config", str(tmp_path / "absent.toml")))
    assert "absent.toml" in line and "cannot read" in line


def test_example_config_loads_and_every_key_is_documented() -> None:
    config = load_config_file(EXAMPLE_CONFIG)
    assert [u.name for u in config.upstreams] == ["local-vllm", "hosted"]
    assert config.upstreams[0].model_map == {"qwen": "Qwen/Qwen2.5-7B-Instruct"}
    assert config.upstreams[1].api_key_env == ["EXAMPLE_API_KEY", "EXAMPLE_API_KEY_2"]
    assert config.upstreams[1].label == "hosted (research team)" and config.upstreams[0].label is None
    assert config.upstreams[1].models == ["gpt-4o-mini"] and config.upstreams[1].headers == {"x-team": "research"}
    doc = (REPO / "docs" / "configuration.md").read_text()
    for key in [*ConfigFile.model_fields, *UpstreamEntry.model_fields]:
        assert f"`{key}`" in doc, key
    for name in Settings.model_fields:
        assert f"CODEBUDDY2API_{name.upper()}" in doc, name


def test_config_error_is_a_settings_error_in_process(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[[upstreams]]\nbase_url = 'http://h/v1'\napi_keys = ['sk-one', 2]\n")
    with pytest.raises(SettingsError) as caught:
        load_config_file(config)
    assert ":3: upstreams[0].api_keys[1]" in str(caught.value) and "sk-one" not in str(caught.value)


def test_version_and_help_show_defaults_and_env_names() -> None:
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"codebuddy2api {__version__}"
    help_text = " ".join(run_cli("serve", "--help").stdout.split())
    assert "[default: 8080; env CODEBUDDY2API_PORT]" in help_text
    assert "[default: compatible; env CODEBUDDY2API_STREAM_MODE]" in help_text
    assert "env CODEBUDDY2API_SIMULATOR" in help_text


# -- routes -------------------------------------------------------------------------------


def test_unknown_routes_and_methods_are_json(gateways: dict[str, Gateway]) -> None:
    url = gateways["compatible"].url
    missing = httpx.get(url + "/v1/no-such-route")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
    assert missing.json() == {"error": {"message": "no route GET /v1/no-such-route", "type": "not_found_error", "param": None, "code": "not_found"}}
    wrong = httpx.delete(url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed" and wrong.json()["error"]["type"] == "invalid_request_error"
    anthropic = httpx.get(url + "/v1/messages")
    assert anthropic.status_code == 405
    assert anthropic.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "method_not_allowed: GET is not allowed on /v1/messages"}}
    elsewhere = httpx.get(url + "/no-such-page")
    assert elsewhere.status_code == 404 and elsewhere.json() == {"error": "not_found", "message": "no route GET /no-such-page"}


def test_sdk_sees_unknown_route_as_a_not_found_error(gateways: dict[str, Gateway]) -> None:
    client = openai.OpenAI(base_url=gateways["compatible"].base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.get("/no-such-route", cast_to=dict)
    assert caught.value.code == "not_found"


def test_retrieve_one_model(gateways: dict[str, Gateway]) -> None:
    client = openai.OpenAI(base_url=gateways["compatible"].base_url, api_key="k", _strict_response_validation=True, max_retries=0)
    model = client.models.retrieve("parallel_tools")
    assert model.id == "parallel_tools" and model.owned_by == "upstream" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found" and "no-such-model" in caught.value.message


def test_anthropic_sdk_lists_and_retrieves_models(gateways: dict[str, Gateway]) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=gateways["compatible"].url, api_key="k", _strict_response_validation=True, max_retries=0)
    listed = [m.id for m in client.models.list()]
    assert "parallel_tools" in listed and listed == sorted(listed)
    model = client.models.retrieve("reasoning")
    assert model.id == "reasoning" and model.type == "model"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_simulator_header_only_when_the_simulator_answers(
    server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory, gateways: dict[str, Gateway]
) -> None:
    body = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}
    real = httpx.post(gateways["compatible"].base_url + "/chat/completions", json=body)
    assert real.status_code == 200 and UPSTREAM_HEADER not in real.headers
    settings = Settings(simulator=True, data_dir=tmp_path_factory.mktemp("sim"))
    simulated = Gateway(server_loop.serve(create_app(settings, {n: "default" for n in Settings.model_fields})), None)
    answer = httpx.post(simulated.base_url + "/chat/completions", json=body)
    assert answer.headers[UPSTREAM_HEADER] == "simulator"
    assert answer.json()["choices"][0]["message"]["content"].startswith("Hello from the codebuddy2api simulator")
    assert httpx.get(simulated.url + "/healthz").headers[UPSTREAM_HEADER] == "simulator"


def test_make_run_passes_simulator_and_takes_a_port() -> None:
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "run", "PORT=9123", "HOST=127.0.0.2"],
                         cwd=REPO, capture_output=True, text=True, timeout=30)  # also under `make test` (a nested make)
    assert dry.returncode == 0, dry.stderr
    [command] = [line for line in dry.stdout.splitlines() if "codebuddy2api serve" in line]
    assert command.endswith("codebuddy2api serve --simulator --host 127.0.0.2 --port 9123 --data-dir ./data")


def test_banner_shows_the_saved_stream_mode(tmp_path: Path) -> None:
    """A mode changed in the WebUI (saved) is the one in force: the banner says that one."""
    from gateway.live_settings import LiveSettings
    from gateway.settings import load_settings
    from gateway.store.db import open_database
    from gateway.store.saved_settings import SavedSettings

    db = open_database(None, tmp_path)
    saved = SavedSettings(db)
    LiveSettings(Settings(data_dir=tmp_path), {n: "default" for n in Settings.model_fields}, saved).update({"stream_mode": "realtime"})
    saved.close()
    db.close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--simulator", "--port", str(port), "--data-dir", str(tmp_path), "--log-level", "error"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    banner = next(json.loads(line) for line in stderr.splitlines() if '"startup"' in line)
    assert banner["stream_mode"] == "realtime" and banner["stream_mode_source"] == "saved"
    assert load_settings({"data_dir": str(tmp_path)})[0].stream_mode == "compatible"  # the base value is untouched
    text = render_text(banner)
    assert "realtime, saved in the WebUI/admin API" in text


def test_credentials_added_in_the_webui_count_as_an_upstream(tmp_path: Path) -> None:
    """An operator who added the upstream through the admin API is not refused off loopback,
    and gets that upstream, not the simulator."""
    from gateway.store.credentials import CredentialState
    from gateway.store.db import open_database

    db = open_database(None, tmp_path)
    CredentialState(db).add_credential("added-1", "webui-upstream", "http://gpu-9.internal:8000/v1", "sk-added")
    db.close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--host", "0.0.0.0", "--port", str(port), "--api-key", "client-key-of-24-chars-01",
         "--data-dir", str(tmp_path), "--log-level", "error"],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        health = httpx.get(f"http://127.0.0.1:{port}/healthz")
        assert UPSTREAM_HEADER not in health.headers
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    banner = next(json.loads(line) for line in stderr.splitlines() if '"startup"' in line)
    assert banner["simulator"] is False
    assert [u["host"] for u in banner["upstreams"]] == ["gpu-9.internal:8000"] and "sk-added" not in stderr


def test_banner_says_capture_is_on_with_its_token_source(tmp_path: Path) -> None:
    off = startup_facts(Settings(upstream_url=["http://h:1/v1"]), [Upstream("upstream", "http://h:1/v1")], None, webui=False)
    assert off["capture"] is None and "capture" not in render_text(off)
    settings = Settings(upstream_url=["http://h:1/v1"], capture_tokens="vllm", capture_dir=tmp_path / "cap", capture_strict=True)
    upstreams = [Upstream("upstream", "http://h:1/v1"),
                 Upstream("llama", "http://l:2/v1", capture_tokens="llamacpp", token_in="llamacpp")]
    facts = startup_facts(settings, upstreams, None, webui=False)
    assert facts["capture"] == {"token_sources": {"upstream": "vllm", "llama": "llamacpp"}, "token_in": {"llama": "llamacpp"},
                                "strict": True, "files": str(tmp_path / "cap")}
    [row] = [line for line in render_text(facts).splitlines() if line.strip().startswith("capture")]
    assert row.split(None, 1)[1] == (f"ON: rollout calls recorded in the store; token ids from upstream vllm, llama llamacpp; "
                                     f"token-in llama llamacpp; files in {tmp_path / 'cap'}; strict")
    # token-in alone (a --config table) turns recording on, as the recorder does
    only_token_in = startup_facts(Settings(), [Upstream("gpu", "http://g:1/v1", capture_tokens="vllm", token_in="vllm")], None, webui=False)
    assert only_token_in["capture"] == {"token_sources": {"gpu": "vllm"}, "token_in": {"gpu": "vllm"}, "strict": False, "files": None}
