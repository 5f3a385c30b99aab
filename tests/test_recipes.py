"""docs/clients.md's recipes, run against a gateway that requires a client key.

The OpenAI and Anthropic Python SDKs come with the dev install (``make test``); LangChain
and the Node libraries are installed outside the repository by ``.ci/recipes.sh`` (``make
test-recipes``, which sets CODEBUDDY2API_REQUIRE_RECIPES so a missing library fails
instead of skipping). Claude Code and Codex are configured, not run: their settings drive
the SDK the same way the CLI would (same base URL, same auth header, same protocol).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import anthropic
import openai
import pytest
from pydantic import SecretStr

from tests.conftest import Gateway, ServerLoop, Simulator, start_gateway

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "clients.md"
KEY = "sk-your-client-key"
DOC_URL = "http://127.0.0.1:8080"
RECIPES_DIR = Path(os.environ.get("CODEBUDDY2API_RECIPES_DIR") or Path.home() / ".cache" / "codebuddy2api" / "recipes")
RECIPE = re.compile(r"<!-- recipe: (\S+) -->\n```(\w+)\n(.*?)```", re.S)

#: recipe -> the lines it must print (the simulator echoes: "You said: <text>")
EXPECTED: dict[str, list[str]] = {
    "openai-python": ["You said: hello from the chat API", "You said: hello from the responses API"],
    "anthropic-python": ["You said: hello from messages"],
    "langchain-python": ["You said: hello from langchain", "You said: streamed from langchain"],
    "openai-node": ["You said: hello from node", "You said: hello from node responses"],
    "anthropic-node": ["You said: hello from node messages"],
    "vercel-ai": ["You said: hello from the ai sdk", "You said: streamed from the ai sdk"],
}


def recipes() -> dict[str, tuple[str, str]]:
    return {name: (lang, code) for name, lang, code in RECIPE.findall(DOC.read_text())}


@pytest.fixture(scope="module")
def keyed(server_loop: ServerLoop, simulator: Simulator, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    return start_gateway(server_loop, simulator, tmp_path_factory, api_key=[SecretStr(KEY)])


def missing(what: str) -> None:
    if os.environ.get("CODEBUDDY2API_REQUIRE_RECIPES"):
        pytest.fail(f"{what} is not installed: run .ci/recipes.sh", pytrace=False)
    pytest.skip(f"{what} is not installed (make test-recipes installs it)")


def test_every_recipe_is_run() -> None:
    assert set(recipes()) == {*EXPECTED, "claude-code", "codex"}


def test_claude_code_settings(keyed: Gateway) -> None:
    lang, code = recipes()["claude-code"]
    env = dict(line.removeprefix("export ").split("=", 1) for line in code.splitlines() if line.startswith("export "))
    assert lang == "sh" and code.strip().endswith("claude")
    base_url = env["ANTHROPIC_BASE_URL"]
    assert base_url == DOC_URL and env["ANTHROPIC_AUTH_TOKEN"] == KEY
    assert {env[k] for k in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")} == {"my-model"}
    # ANTHROPIC_AUTH_TOKEN -> Authorization: Bearer, as Claude Code sends it
    client = anthropic.Anthropic(base_url=base_url.replace(DOC_URL, keyed.url), auth_token=env["ANTHROPIC_AUTH_TOKEN"], _strict_response_validation=True, max_retries=0)
    messages = [{"role": "user", "content": "hi from claude code"}]
    with client.messages.stream(model=env["ANTHROPIC_MODEL"], max_tokens=256, messages=messages) as stream:  # type: ignore[arg-type]
        assert stream.get_final_message().content[0].text == "You said: hi from claude code"  # type: ignore[union-attr]
    assert client.messages.count_tokens(model=env["ANTHROPIC_MODEL"], messages=messages).input_tokens > 0  # type: ignore[arg-type]
    wrong = anthropic.Anthropic(base_url=keyed.url, auth_token="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="my-model", max_tokens=16, messages=messages)  # type: ignore[arg-type]


def test_codex_provider(keyed: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    lang, code = recipes()["codex"]
    config = tomllib.loads(code)
    provider = config["model_providers"][config["model_provider"]]
    assert lang == "toml" and provider["wire_api"] == "responses" and provider["base_url"] == DOC_URL + "/v1"
    assert "env_key" not in provider  # Codex asks the gateway for its model metadata only with auth.command
    monkeypatch.setenv("CODEBUDDY2API_CLIENT_KEY", KEY)
    printed = subprocess.run([provider["auth"]["command"], *provider["auth"]["args"]], capture_output=True, text=True, check=True)
    token = printed.stdout.strip()  # what Codex sends as the Bearer token
    assert token == KEY
    base_url = provider["base_url"].replace(DOC_URL, keyed.url)
    client = openai.OpenAI(base_url=base_url, api_key=token, _strict_response_validation=True, max_retries=0)
    with client.responses.stream(model=config["model"], input="hi from codex") as stream:
        assert stream.get_final_response().output_text == "You said: hi from codex"
    catalog = client.get("/models", cast_to=object, options={"params": {"client_version": "0.171.0"}})
    assert isinstance(catalog, dict) and [m["slug"] for m in catalog["models"]]  # Codex's shape


def run_recipe(name: str, keyed: Gateway, tmp_path: Path) -> list[str]:
    lang, code = recipes()[name]
    code = code.replace(DOC_URL, keyed.url)
    if lang == "python":
        if name == "langchain-python":
            python = RECIPES_DIR / "venv" / "bin" / "python"
            if not python.exists():
                missing("langchain-openai")
        else:  # the official SDKs of the dev install, in strict mode
            python = Path(sys.executable)
            code = code.replace(f'api_key="{KEY}")', f'api_key="{KEY}", _strict_response_validation=True)')
            assert "_strict_response_validation=True" in code
        command = [str(python), "-c", code]
    else:
        modules = RECIPES_DIR / "node" / "node_modules"
        if not modules.is_dir():
            missing("the Node client libraries")
        (tmp_path / "node_modules").symlink_to(modules)
        script = tmp_path / f"{name}.mjs"
        script.write_text(code)
        command = ["node", str(script)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_recipe_prints_the_answers(name: str, keyed: Gateway, tmp_path: Path) -> None:
    assert run_recipe(name, keyed, tmp_path) == EXPECTED[name]


def test_recipes_carry_the_key(keyed: Gateway) -> None:
    """The gateway really checks the key the recipes send (a wrong one is refused)."""
    client = openai.OpenAI(base_url=keyed.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "x"}])
    assert shlex.quote(KEY) == KEY  # the doc's key needs no quoting in the shell recipe
