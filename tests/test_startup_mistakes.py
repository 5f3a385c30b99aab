"""Operator mistakes at start-up (gateway/startup_checks.py): each is one line on stderr,
naming the file, flag or variable, and exit status 2 -- never a traceback, never ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.startup_checks import NOT_SETTINGS, misspelt_variable, setting_variables
from tests.test_startup import clean_env, one_line_refusal, run_cli

REPO = Path(__file__).resolve().parent.parent
UPSTREAM = ("--upstream-url", "http://127.0.0.1:9/v1")


def test_missing_upstream_key_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "upstream.key"
    line = one_line_refusal(run_cli("serve", *UPSTREAM, "--upstream-api-key-file", str(missing), "--data-dir", str(tmp_path)))
    assert line == f"codebuddy2api: error: --upstream-api-key-file {missing}: no such file"


def test_key_file_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    line = one_line_refusal(run_cli("serve", *UPSTREAM, "--data-dir", str(tmp_path),
                                    env=clean_env(CODEBUDDY2API_UPSTREAM_API_KEY_FILE=str(tmp_path))))
    assert line.startswith(f"codebuddy2api: error: CODEBUDDY2API_UPSTREAM_API_KEY_FILE {tmp_path}: is a directory")


def test_empty_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.key"
    empty.write_text("# no key yet\n\n")
    line = one_line_refusal(run_cli("serve", *UPSTREAM, "--upstream-api-key-file", str(empty), "--data-dir", str(tmp_path)))
    assert "no key in it" in line and str(empty) in line


@pytest.mark.parametrize(("typo", "meant"), [
    ("CODEBUDDY2API_STREM_MODE", "CODEBUDDY2API_STREAM_MODE"),
    ("CODEBUDDY2API_API_KEYS", "CODEBUDDY2API_API_KEY"),
    ("CODEBUDDY2API_UPSTREAM_URLS", "CODEBUDDY2API_UPSTREAM_URL"),
    ("CODEBUDDY2API_ADMINTOKEN", "CODEBUDDY2API_ADMIN_TOKEN"),
])
def test_misspelt_variable_names_the_closest_setting(tmp_path: Path, typo: str, meant: str) -> None:
    line = one_line_refusal(run_cli("serve", "--simulator", "--data-dir", str(tmp_path), env=clean_env(**{typo: "x"})))
    assert line == f"codebuddy2api: error: environment: {typo} is not a setting; did you mean {meant}?"


def test_misspelt_variable_in_dot_env_names_the_file(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("CODEBUDDY2API_LOG_LEVEL=info\nCODEBUDDY2API_KEEPALIVE_INTERVALL=3\nOTHER_TOOL=1\n")
    line = one_line_refusal(run_cli("serve", "--simulator", "--data-dir", str(tmp_path / "d"), cwd=tmp_path))
    assert line == ("codebuddy2api: error: .env: CODEBUDDY2API_KEEPALIVE_INTERVALL is not a setting; "
                    "did you mean CODEBUDDY2API_KEEPALIVE_INTERVAL?")


def test_unknown_variable_far_from_any_setting_still_refused() -> None:
    problem = misspelt_variable(["CODEBUDDY2API_ZZZZZZZZZZZZZZZZZZZZ"])
    assert problem and "is not a setting" in problem and "serve --help" in problem
    assert misspelt_variable(setting_variables()) is None  # every real name passes
    assert misspelt_variable(NOT_SETTINGS) is None  # the project's own script switches pass
    assert misspelt_variable(["PATH", "HOME", "OPENAI_API_KEY"]) is None  # other prefixes are not ours


def _example_env() -> dict[str, str]:
    """deploy/.env.example's CODEBUDDY2API_* values, as a new operator would copy them."""
    values: dict[str, str] = {}
    for line in (REPO / "deploy" / ".env.example").read_text().splitlines():
        if line.startswith("CODEBUDDY2API_") and "=" in line:
            name, value = line.split("=", 1)
            values[name] = value
    return values


@pytest.mark.parametrize("variable", ["CODEBUDDY2API_API_KEY", "CODEBUDDY2API_ADMIN_TOKEN"])
def test_example_placeholders_are_refused_as_secrets(tmp_path: Path, variable: str) -> None:
    placeholder = _example_env()[variable]
    assert placeholder.startswith("change-me")
    env = clean_env(**{variable: placeholder})
    line = one_line_refusal(run_cli("serve", "--simulator", "--data-dir", str(tmp_path), env=env))
    assert line.startswith(f"codebuddy2api: error: {variable} is still a change-me-* placeholder")
    assert placeholder not in line  # named, not echoed


def test_placeholder_flag_and_database_url_and_key_file_are_refused(tmp_path: Path) -> None:
    line = one_line_refusal(run_cli("serve", "--simulator", "--data-dir", str(tmp_path), "--api-key", "change-me-client-key"))
    assert line.startswith("codebuddy2api: error: --api-key is still a change-me-* placeholder")
    url = "postgresql://codebuddy2api:change-me-postgres@127.0.0.1:9/codebuddy2api"
    line = one_line_refusal(run_cli("serve", "--simulator", "--data-dir", str(tmp_path), env=clean_env(CODEBUDDY2API_DATABASE_URL=url)))
    assert line.startswith("codebuddy2api: error: CODEBUDDY2API_DATABASE_URL is still a change-me-* placeholder")
    assert "change-me-postgres" not in line
    key_file = tmp_path / "upstream.key"
    key_file.write_text("change-me-upstream-key\n")
    line = one_line_refusal(run_cli("serve", *UPSTREAM, "--upstream-api-key-file", str(key_file), "--data-dir", str(tmp_path)))
    assert line == f"codebuddy2api: error: --upstream-api-key-file {key_file}: holds a change-me-* placeholder; put the real key in it"


def test_litellm_yaml_config_gets_a_hint(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("model_list:\n  - model_name: gpt-4o\n    litellm_params:\n      model: openai/gpt-4o\n"
                      "      api_base: http://127.0.0.1:8000/v1\n")
    line = one_line_refusal(run_cli("serve", "--config", str(config), "--data-dir", str(tmp_path)))
    assert line.startswith(f"codebuddy2api: error: --config {config}: looks like a LiteLLM proxy config (YAML)")
    assert "[[upstreams]]" in line and "examples/config.toml" in line


def test_other_yaml_config_is_named_as_yaml(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yml"
    config.write_text("upstreams:\n  - base_url: http://127.0.0.1:8000/v1\n")
    line = one_line_refusal(run_cli("serve", "--data-dir", str(tmp_path), env=clean_env(CODEBUDDY2API_CONFIG=str(config))))
    assert line == (f"codebuddy2api: error: CODEBUDDY2API_CONFIG {config}: is YAML; --config is a TOML file "
                    "(examples/config.toml, docs/configuration.md)")


def test_a_sound_start_passes_the_checks(tmp_path: Path) -> None:
    """The checks refuse only mistakes: real secrets, a real key file and a TOML config pass."""
    from gateway.settings import load_settings
    from gateway.startup_checks import operator_mistake

    key_file = tmp_path / "upstream.key"
    key_file.write_text("# the vLLM key\nsk-real-upstream-key-0123456789\n")
    config = tmp_path / "config.toml"
    config.write_text('[[upstreams]]\nbase_url = "http://127.0.0.1:8000/v1"\n')
    settings, sources = load_settings({"upstream_api_key_file": key_file, "api_key": ["client-key-0123456789abcdef"],
                                       "admin_token": "admin-token-0123456789abcdef"})
    assert operator_mistake(settings, sources, {"CODEBUDDY2API_STREAM_MODE": "realtime"}) is None
    settings, sources = load_settings({"config": config})
    assert operator_mistake(settings, sources, {}) is None
