"""deploy/kubernetes/base/: every manifest validates against a pinned Kubernetes version's schemas
(kubernetes-validate ships them: no cluster, no network), and the manifests agree with the
gateway: probe paths that exist, a grace period above --shutdown-timeout, every writable
path on a volume, every referenced Secret/ConfigMap key present, a config.toml that loads.
The overlays (deploy/kubernetes/overlays/dev, prod) are rendered with ``kubectl kustomize``
(kustomize v5 built into kubectl: offline) and validated the same way."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser
from gateway.settings import ENV_PREFIX, Settings
from gateway.upstream.config_file import load_config_file

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes" / "base"
OVERLAYS = REPO / "deploy" / "kubernetes" / "overlays"
#: The Kubernetes version the manifests are checked against (the oldest still supported
#: upstream when this was written; the manifests use nothing newer).
KUBERNETES_VERSION = "1.33.0"
#: Kinds the built-in schemas do not cover (a CRD; kustomize's own file), checked by hand below.
NOT_IN_SCHEMAS = {"ServiceMonitor", "Kustomization"}


def _manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one document of that kind."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in found, f"two {doc['kind']} documents"
            found[doc["kind"]] = doc | {"_file": path.name}
    return found


MANIFESTS = _manifests()


def _strip(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "_file"}


@pytest.mark.parametrize("kind", sorted(set(MANIFESTS) - NOT_IN_SCHEMAS))
def test_manifest_validates_strictly(kind: str) -> None:
    """Strict: an unknown or misplaced field (a typo) fails, not only a wrong type."""
    doc = _strip(MANIFESTS[kind])
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_catches_a_typo() -> None:
    """The check above can fail: a misspelt field and a wrong type are both refused."""
    deployment = _strip(MANIFESTS["Deployment"])
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_optional_servicemonitor() -> None:
    listed = MANIFESTS["Kustomization"]["resources"]
    files = {doc["_file"] for doc in MANIFESTS.values()} - {"kustomization.yaml"}
    assert set(listed) == files - {"servicemonitor.yaml"}
    assert "servicemonitor.yaml" in (KUBE / "kustomization.yaml").read_text()  # named, commented out


def _container() -> dict[str, Any]:
    (container,) = MANIFESTS["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _env() -> dict[str, Any]:
    return {e["name"]: e for e in _container()["env"]}


def test_probes_and_grace_period_fit_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_packaging import _app_paths

    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    container = _container()
    paths = _app_paths()
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" in paths
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" in paths
    port = container["ports"][0]
    assert port["containerPort"] == 8080 and _env()["CODEBUDDY2API_PORT"]["value"] == "8080"
    shutdown = float(MANIFESTS["ConfigMap"]["data"]["CODEBUDDY2API_SHUTDOWN_TIMEOUT"])
    pause = shlex.split(" ".join(container["lifecycle"]["preStop"]["exec"]["command"]))
    pause_seconds = float(pause[-1].rsplit("(", 1)[1].rstrip(")"))
    assert pause_seconds > 0
    assert pod["terminationGracePeriodSeconds"] > pause_seconds + shutdown
    strategy = MANIFESTS["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0  # a rolling update never drops below the replica count
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_non_root_read_only_and_every_written_path_on_a_volume() -> None:
    pod = MANIFESTS["Deployment"]["spec"]["template"]["spec"]
    container = _container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"--uid {pod['securityContext']['runAsUser']}" in dockerfile  # the image's user
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    data_dir = _env()["CODEBUDDY2API_DATA_DIR"]["value"]
    settings = Settings(data_dir=Path(data_dir))
    spill = settings.spill_dir or settings.data_dir / "spill"
    for path in (data_dir, str(spill), "/tmp"):
        assert any(path == w or path.startswith(w + "/") for w in writable), path
    volumes = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes


def test_every_key_referenced_exists_and_every_variable_is_a_setting(tmp_path: Path) -> None:
    secret = MANIFESTS["Secret"]["stringData"]
    config_map = MANIFESTS["ConfigMap"]["data"]
    settings_vars = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    for name, entry in _env().items():
        source = entry.get("valueFrom", {})
        if "secretKeyRef" in source:
            assert source["secretKeyRef"]["name"] == MANIFESTS["Secret"]["metadata"]["name"]
            assert source["secretKeyRef"]["key"] in secret, name
        if "configMapKeyRef" in source:
            assert source["configMapKeyRef"]["key"] in config_map, name
        if name.startswith(ENV_PREFIX):
            assert name in settings_vars, name  # a misspelt one is refused at start-up
    for name in config_map:
        if name.startswith(ENV_PREFIX):
            assert name in settings_vars, name
    assert "postgresql://" in secret["database-url"]  # PostgreSQL by URL: every replica shares it
    # the args parse, and the --config they name is the ConfigMap's config.toml, which loads
    args = build_parser().parse_args(_container()["args"])
    config_path = Path(args.config)
    mount = next(m for m in _container()["volumeMounts"] if m["name"] == "config")
    assert config_path.parent == Path(mount["mountPath"])
    config_volume = next(v for v in MANIFESTS["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["items"] == [{"key": config_path.name, "path": config_path.name}]
    (tmp_path / config_path.name).write_text(config_map[config_path.name])
    loaded = load_config_file(tmp_path / config_path.name)
    for upstream in loaded.upstreams:
        assert upstream.base_url.endswith("/v1")
        for env_name in upstream.api_key_env:
            assert env_name in _env(), env_name  # the key the TOML reads is put there


def test_service_pdb_hpa_and_servicemonitor_select_the_pods() -> None:
    labels = MANIFESTS["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert MANIFESTS["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = MANIFESTS["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == _container()["ports"][0]["name"]
    assert MANIFESTS["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = MANIFESTS["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == MANIFESTS["Deployment"]["metadata"]["name"]
    assert hpa["minReplicas"] == MANIFESTS["Deployment"]["spec"]["replicas"] == 3
    monitor = MANIFESTS["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas are in the package: with every socket connect refused, validation still runs."""
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("kubernetes-validate opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    kubernetes_validate.validate(_strip(MANIFESTS["Service"]), KUBERNETES_VERSION, strict=True)
    bad = _strip(MANIFESTS["Service"]) | {"spek": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


# -- what the comments and docs say matches the code (issue #38) ------------------------------


def test_the_secrets_comments_say_what_the_code_does() -> None:
    from gateway.settings import MIN_OPERATOR_SECRET

    text = (KUBE / "secret.yaml").read_text()
    lengths = {int(n) for n in re.findall(r"at least (\d+) characters", text)}
    assert lengths == {MIN_OPERATOR_SECRET}  # was 24 while the code asks 16
    env = _env()
    # every Secret key's comment (the lines just above it) names the variable the Deployment puts it in
    lines = text.splitlines()
    for key in MANIFESTS["Secret"]["stringData"]:
        [variable] = [name for name, entry in env.items()
                      if entry.get("valueFrom", {}).get("secretKeyRef", {}).get("key") == key]
        at = lines.index(next(line for line in lines if line.startswith(f"  {key}:")))
        comment = []
        while lines[at - 1].lstrip().startswith("#"):
            at -= 1
            comment.append(lines[at])
        assert variable in " ".join(comment), (key, variable)
    assert "--upstream-api-key-file" not in text and "mounted as a file" not in text  # it is a variable


def test_max_concurrent_per_pod_is_stated_and_matches_the_shares() -> None:
    from gateway.store.replicas import share

    config_map = MANIFESTS["ConfigMap"]["data"]
    cap = int(config_map["CODEBUDDY2API_MAX_CONCURRENT"])
    assert "CODEBUDDY2API_MAX_CONCURRENT" in _env()  # the pods really get it
    hpa = MANIFESTS["HorizontalPodAutoscaler"]["spec"]
    assert cap >= hpa["maxReplicas"]  # else some pods would get a share of 0
    text = (KUBE / "configmap.yaml").read_text()
    for pods in (hpa["minReplicas"], hpa["maxReplicas"]):
        ids = [f"pod-{n:02d}" for n in range(pods)]
        shares = "/".join(str(share(cap, ids, me)) for me in ids)
        assert f"{pods} pods" in text and shares in text, (pods, shares)
    assert "max_concurrent" in (REPO / "docs" / "scaling.md").read_text().split("## On Kubernetes", 1)[1]


def test_the_image_is_named_in_one_place_at_the_gateways_version() -> None:
    """kustomization.yaml's images entry names the Deployment's image (the one place to put
    a registry path), at this release's version; docs/scaling.md says how to build and push it."""
    from gateway import __version__

    [entry] = MANIFESTS["Kustomization"]["images"]
    image = _container()["image"]
    assert image.split(":")[0] == entry["name"] and entry["newTag"] == __version__ == image.split(":")[1]
    docs = (REPO / "docs" / "scaling.md").read_text()
    assert "docker push" in docs and "kustomize edit set image" in docs


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_named_image(tmp_path: Path) -> None:
    """Offline: ``kubectl kustomize`` builds the kit, and a set image reaches the Deployment."""
    copy = tmp_path / "kit"
    shutil.copytree(KUBE, copy)
    text = (copy / "kustomization.yaml").read_text().replace("newName: codebuddy2api", "newName: registry.example.com/t/codebuddy2api")
    (copy / "kustomization.yaml").write_text(text)
    rendered = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = list(yaml.safe_load_all(rendered.stdout))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/t/codebuddy2api:" + \
        MANIFESTS["Kustomization"]["images"][0]["newTag"]
    assert {d["kind"] for d in docs} == {m["kind"] for m in MANIFESTS.values()} - {"Kustomization", "ServiceMonitor"}


def _render(folder: Path) -> list[dict[str, Any]]:
    rendered = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    return list(yaml.safe_load_all(rendered.stdout))


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


#: What each overlay changes: namespace, replicas, HPA range, image, requests, ConfigMap values.
OVERLAY_FACTS = {
    "dev": {"namespace": "codebuddy2api-dev", "replicas": 1, "hpa": (1, 2), "image": "codebuddy2api:0.1.0",
            "cpu": "100m", "config": {"CODEBUDDY2API_LOG_LEVEL": "debug", "CODEBUDDY2API_MAX_CONCURRENT": "16"}},
    "prod": {"namespace": "codebuddy2api", "replicas": 3, "hpa": (3, 10),
             "image": "registry.example.com/team/codebuddy2api:0.1.0", "cpu": "1",
             "config": {"CODEBUDDY2API_LOG_LEVEL": "info", "CODEBUDDY2API_MAX_CONCURRENT": "64"}},
}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", sorted(OVERLAY_FACTS))
def test_each_overlay_renders_validates_and_changes_only_what_it_says(overlay: str) -> None:
    """Offline: the overlay renders over the base, every document validates strictly, and it
    differs from the base in its namespace and its patched fields only (the rest, probes,
    security context, volumes, env, is the base's)."""
    facts = OVERLAY_FACTS[overlay]
    docs = _render(OVERLAYS / overlay)
    base = {d["kind"]: d for d in _render(KUBE)}
    assert {d["kind"] for d in docs} == set(base)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["metadata"]["namespace"] == facts["namespace"], doc["kind"]
    deployment = _one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == facts["replicas"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == facts["image"] and container["resources"]["requests"]["cpu"] == facts["cpu"]
    [base_container] = base["Deployment"]["spec"]["template"]["spec"]["containers"]
    for field in ("env", "readinessProbe", "livenessProbe", "startupProbe", "securityContext", "volumeMounts", "args"):
        assert container[field] == base_container[field], field  # a patch sets fields, it drops none
    hpa = _one(docs, "HorizontalPodAutoscaler")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == facts["hpa"]
    data = _one(docs, "ConfigMap")["data"]
    assert {k: data[k] for k in facts["config"]} == facts["config"]
    assert data["config.toml"] == base["ConfigMap"]["data"]["config.toml"]
    assert int(data["CODEBUDDY2API_MAX_CONCURRENT"]) >= hpa["maxReplicas"]  # no pod with a share of 0
    selector = deployment["spec"]["selector"]["matchLabels"]
    for kind in ("Service", "PodDisruptionBudget"):
        doc = _one(docs, kind)["spec"]
        assert (doc.get("selector", {}).get("matchLabels") or doc.get("selector")) == selector, kind


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_top_level_kustomization_is_the_base() -> None:
    """``kubectl apply -k deploy/kubernetes/`` (what the docs said before the overlays) still
    applies the base as it is."""
    assert _render(KUBE.parent) == _render(KUBE)
