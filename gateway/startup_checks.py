"""Operator mistakes caught before ``serve`` starts, each one line (the CLI prints it and
exits 2): a misspelt ``CODEBUDDY2API_*`` variable, an ``--upstream-api-key-file`` that
cannot be read, a ``change-me-*`` placeholder from deploy/.env.example kept as a secret,
a LiteLLM-style YAML file given to ``--config``.

Each check is its own small function returning the problem (or ``None``), so other
refusals (secret lengths, URLs) sit beside them in the CLI's one refusal path.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path

from gateway.settings import ENV_PREFIX, Settings, Source

#: ``CODEBUDDY2API_*`` names that are not settings but belong to the project: the worker
#: hand-over (gateway.cli) and the test/CI scripts' own switches (tests/, .ci/, Makefile).
NOT_SETTINGS: frozenset[str] = frozenset({
    "CODEBUDDY2API_WORKER_CLI_VALUES", "CODEBUDDY2API_WORKER_ADMIN_LOGIN_TOKEN",
    "CODEBUDDY2API_TEST_DATABASE_URL", "CODEBUDDY2API_REQUIRE_LLAMA", "CODEBUDDY2API_REQUIRE_RECIPES",
    "CODEBUDDY2API_LLAMA_DIR", "CODEBUDDY2API_LCP_DIR", "CODEBUDDY2API_CLIENTS",
    "CODEBUDDY2API_RECIPES_DIR", "CODEBUDDY2API_CLIENT_KEY",
})

#: deploy/.env.example and deploy/kubernetes/base/secret.yaml ship these; kept, they are known to all.
PLACEHOLDER_PREFIX = "change-me"

#: Secret settings a placeholder may be left in.
SECRET_FIELDS = ("api_key", "admin_token", "upstream_api_key", "database_url")


def setting_variables() -> list[str]:
    return sorted(f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields)


def misspelt_variable(names: Iterable[str], where: str = "environment") -> str | None:
    """The first ``CODEBUDDY2API_*`` name that is no setting, with the closest one that is.
    pydantic-settings ignores unknown names, so a typo would silently drop the setting."""
    valid = setting_variables()
    for name in sorted(names):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in valid or upper in NOT_SETTINGS:
            continue
        close = difflib.get_close_matches(upper, valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see `codebuddy2api serve --help` for the variables"
        return f"{where}: {name} is not a setting; {hint}"
    return None


def dotenv_names(path: Path = Path(".env")) -> list[str]:
    """The variable names of the ``.env`` file Settings reads (none when there is none)."""
    if not path.is_file():
        return []
    from dotenv import dotenv_values  # python-dotenv: pydantic-settings' own .env reader

    return list(dotenv_values(path))


def flag_or_variable(name: str, sources: Mapping[str, Source]) -> str:
    """How the operator set ``name``: the flag, or the variable."""
    if sources.get(name) == "cli":
        return "--" + name.replace("_", "-")
    return f"{ENV_PREFIX}{name.upper()}"


def unreadable_key_file(settings: Settings, sources: Mapping[str, Source]) -> str | None:
    """``--upstream-api-key-file`` must be a readable file with at least one key in it."""
    path = settings.upstream_api_key_file
    if path is None:
        return None
    where = f"{flag_or_variable('upstream_api_key_file', sources)} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{where}: no such file"
    except IsADirectoryError:
        return f"{where}: is a directory, not a file with one key per line"
    except PermissionError:
        return f"{where}: permission denied (the gateway runs as a user that cannot read it)"
    except (OSError, UnicodeDecodeError) as exc:
        return f"{where}: cannot read it: {getattr(exc, 'strerror', None) or exc}"
    if not any(line.strip() and not line.startswith("#") for line in text.splitlines()):
        return f"{where}: no key in it (one key per line; # starts a comment)"
    return None


def _secret_values(settings: Settings, name: str) -> list[str]:
    value = getattr(settings, name)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [v.get_secret_value() for v in values]


def placeholder_secret(settings: Settings, sources: Mapping[str, Source]) -> str | None:
    """A ``change-me-*`` value of the example files is public: refuse it as a secret."""
    for name in SECRET_FIELDS:
        for value in _secret_values(settings, name):
            if PLACEHOLDER_PREFIX in value.lower():
                return (f"{flag_or_variable(name, sources)} is still a {PLACEHOLDER_PREFIX}-* placeholder "
                        "from the example files; set a real secret")
    path = settings.upstream_api_key_file
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None  # unreadable_key_file reports it
        if PLACEHOLDER_PREFIX in text.lower():
            return f"{flag_or_variable('upstream_api_key_file', sources)} {path}: holds a {PLACEHOLDER_PREFIX}-* placeholder; put the real key in it"
    return None


#: Top-level keys of a LiteLLM proxy config.yaml.
LITELLM_KEYS = ("model_list:", "litellm_settings:", "general_settings:", "router_settings:")


def yaml_config(settings: Settings, sources: Mapping[str, Source]) -> str | None:
    """``--config`` is TOML; a YAML file (a LiteLLM proxy config most likely) gets a hint
    instead of a TOML parse error."""
    path = settings.config
    if path is None:
        return None
    try:
        head = Path(path).read_text(encoding="utf-8", errors="replace")[:65536]
    except OSError:
        return None  # load_config_file names it
    stripped = [line for line in head.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    litellm = any(line.startswith(LITELLM_KEYS) for line in stripped)
    if not (litellm or Path(path).suffix.lower() in (".yaml", ".yml")):
        return None
    where = f"{flag_or_variable('config', sources)} {path}"
    if litellm:
        return (f"{where}: looks like a LiteLLM proxy config (YAML); codebuddy2api reads TOML: one "
                "[[upstreams]] table per api_base with base_url, api_key_env and model_map "
                "(examples/config.toml, docs/configuration.md)")
    return f"{where}: is YAML; --config is a TOML file (examples/config.toml, docs/configuration.md)"


def operator_mistake(settings: Settings, sources: Mapping[str, Source], environ: Mapping[str, str]) -> str | None:
    """The first of the checks above that finds something, else ``None``."""
    return (
        misspelt_variable(environ)
        or misspelt_variable(dotenv_names(), ".env")
        or unreadable_key_file(settings, sources)
        or placeholder_secret(settings, sources)
        or yaml_config(settings, sources)
    )
