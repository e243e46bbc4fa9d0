"""The Kubernetes manifests (deploy/kubernetes/, docs/deployment.md), checked without a cluster.

Each overlay is rendered with ``kubectl kustomize``; every object it renders must validate
against the Kubernetes API's schemas, strictly (an unknown field fails), offline with the
``kubernetes-validate`` package; then what the manifests claim is checked against the code
they run: the probes' paths are routes of the real app, every container's arguments parse
with the real ``headwater`` parser, grace periods outlast the drains, no container runs as
root, every file option points into a mounted volume, resources are set.

Without ``kubectl`` or ``kubernetes-validate`` the tests skip with the reason, except under
CI (``CI=true``), where either missing is a failure. No network: rendering is local.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from headwater.cli import build_parser
from headwater.machine import cgroup_cpu_limit

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())
EXAMPLES = sorted((KUBERNETES / "examples").glob("*.yaml"))
#: The Kubernetes version whose API schemas the manifests are checked against.
KUBERNETES_VERSION = "1.32.0"
#: Options naming a file that holds a secret: each must point into a Secret volume.
SECRET_FILE_OPTIONS = (
    "--plane-secret-file",
    "--api-keys-file",
    "--plane-tls-certfile",
    "--plane-tls-keyfile",
    "--plane-tls-ca-file",
    "--etcd-password-file",
)
#: Options naming a file or directory: each must point into a mounted volume.
PATH_OPTIONS = (*SECRET_FILE_OPTIONS, "--tokenizer", "--model")
#: Custom resources in the examples, whose schemas (their CRDs) are not available offline.
CUSTOM_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}


def _require(what: str, present: bool) -> None:
    """Skip without *what* (fail under CI=true, which must provide it)."""
    if present:
        return
    why = f"{what} is not installed (.ci/run installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; CI must provide it")
    pytest.skip(why)


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """The objects ``kubectl kustomize`` renders for *overlay*."""
    _require("kubectl", shutil.which("kubectl") is not None)
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay}: {out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in render(overlay) if o["kind"] == kind]


def pod_specs(docs: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod spec) of every workload among *docs*."""
    for o in docs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def headwater_containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for c in spec["containers"]:
        if c["image"].split(":")[0] in ("headwater", "headwater-vllm"):
            yield c


def expanded_args(container: dict[str, Any]) -> list[str]:
    """The container's args with ``$(VAR)`` as Kubernetes expands it: a downward-API
    field stands for a plausible value (the pod's IP), a plain value for itself."""
    values = {
        "status.podIP": "10.0.0.7",
        "metadata.name": "pod-0",
        "metadata.namespace": "default",
    }
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = values[e["valueFrom"]["fieldRef"]["fieldPath"]]

    def expand(arg: str) -> str:
        def one(m: re.Match[str]) -> str:
            assert m.group(1) in env, f"{arg}: $({m.group(1)}) is not set in the container"
            return env[m.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg)

    return [expand(a) for a in container["args"]]


def parsed(container: dict[str, Any]) -> Any:
    """The container's args parsed by the real ``headwater`` parser of their command."""
    args = expanded_args(container)
    parser = build_parser(args[0])
    try:
        return parser.parse_args(args[1:])
    except SystemExit:
        pytest.fail(f"{container['name']}: headwater {' '.join(args)} does not parse")


def option_value(args: list[str], option: str) -> str | None:
    for i, arg in enumerate(args):
        if arg.startswith(option + "="):
            return arg.partition("=")[2]
        if arg == option and i + 1 < len(args):
            return args[i + 1]
    return None


# ---- rendering and the API schemas ---------------------------------------------------------


def test_there_are_the_overlays_the_docs_describe() -> None:
    assert {"aggregated", "disaggregated", "disaggregated-mtls", "vllm"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_strictly(overlay: str) -> None:
    _require("kubernetes-validate", _has_kubernetes_validate())
    import kubernetes_validate

    for o in render(overlay):
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"overlays/{overlay}: {o['kind']} {o['metadata']['name']}: {exc}")


def test_strict_validation_refuses_an_unknown_field() -> None:
    """What the test above relies on: a field the API does not have fails."""
    _require("kubernetes-validate", _has_kubernetes_validate())
    import kubernetes_validate

    deployment = objects("aggregated", "Deployment")[0]
    bad = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_except_their_custom_resources(example: Path) -> None:
    _require("kubernetes-validate", _has_kubernetes_validate())
    import kubernetes_validate

    docs = tuple(d for d in yaml.safe_load_all(example.read_text()) if d)
    for o in docs:
        if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS:
            continue  # its CRD's schema is not available offline
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    for _, spec in pod_specs(docs):
        for c in headwater_containers(spec):
            parsed(c)
            assert_probes_are_served(c, expanded_args(c)[0])


def _has_kubernetes_validate() -> bool:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return False
    return True


# ---- what the manifests claim of the code ---------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_args_parse_with_the_real_cli(overlay: str) -> None:
    commands = set()
    for _, spec in pod_specs(render(overlay)):
        for c in headwater_containers(spec):
            parsed(c)
            commands.add(c["args"][0])
    assert commands == {"serve", "worker"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_routes_the_processes_serve(overlay: str) -> None:
    for _, spec in pod_specs(render(overlay)):
        for c in headwater_containers(spec):
            assert_probes_are_served(c, c["args"][0])


def assert_probes_are_served(container: dict[str, Any], command: str) -> None:
    probes = [
        container[k] for k in ("livenessProbe", "readinessProbe", "startupProbe") if k in container
    ]
    assert probes, f"{container['name']} has no probe"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = expanded_args(container)
    for probe in probes:
        if "tcpSocket" in probe:
            assert probe["tcpSocket"]["port"] == "plane"
            assert command == "worker"
            continue
        get = probe["httpGet"]
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        if command == "serve":
            assert port == int(option_value(args, "--port") or 0)
            assert get["path"] in frontend_paths(), f"the frontend serves no {get['path']}"
        else:
            assert port == int(option_value(args, "--metrics-port") or 0)
            assert worker_metrics_serves(get["path"]), f"a worker serves no {get['path']}"
    if command == "serve":  # liveness: the process; readiness: /health, 503 while draining
        assert container["livenessProbe"]["httpGet"]["path"] == "/live"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"


@cache
def frontend_paths() -> frozenset[str]:
    """The GET paths the real frontend app routes (no argument in them)."""
    from frontend.config import FrontendConfig
    from frontend.server import Frontend

    from frontend_fixture import shared_tokenizer

    app = Frontend(FrontendConfig(port=0), tokenizer=shared_tokenizer()).app
    return frozenset(
        r.rule for r in app.url_map.iter_rules() if "GET" in (r.methods or ()) and "<" not in r.rule
    )


def worker_metrics_serves(path: str) -> bool:
    """Whether a worker's metrics endpoint answers ``GET path`` with 200."""
    import trio
    from prometheus_client import CollectorRegistry

    from headwater.instrumentation.exposition import TextExposition
    from workers.metrics_endpoint import _respond

    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    status, _, _ = trio.run(_respond, TextExposition(CollectorRegistry()), None, head)
    return status.startswith("200")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_outlasts_the_drain(overlay: str) -> None:
    for name, spec in pod_specs(render(overlay)):
        for c in headwater_containers(spec):
            args = parsed(c)
            # serve: the drain, then what is still in flight gets --graceful-timeout.
            stop = args.drain_timeout + getattr(args, "graceful_timeout", 0.0)
            assert args.drain_timeout > 0, f"{name}: no drain"
            assert spec["terminationGracePeriodSeconds"] > stop, f"{name}: SIGKILL mid-drain"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_container_runs_as_root(overlay: str) -> None:
    for name, spec in pod_specs(render(overlay)):
        pod = spec.get("securityContext", {})
        for c in spec["containers"]:
            ctx = {**pod, **c.get("securityContext", {})}
            assert ctx.get("runAsNonRoot") is True, f"{name}/{c['name']}"
            assert ctx.get("runAsUser", 0) != 0, f"{name}/{c['name']}"
            assert ctx.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_are_set(overlay: str) -> None:
    for name, spec in pod_specs(render(overlay)):
        for c in spec["containers"]:
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), f"{name}/{c['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_file_options_point_into_mounted_volumes(overlay: str) -> None:
    """A secret's option names a file of a mounted Secret (one of its keys, when the
    volume lists them); a model or tokenizer path lies in a mounted volume."""
    for name, spec in pod_specs(render(overlay)):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in headwater_containers(spec):
            args = expanded_args(c)
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            for option in PATH_OPTIONS:
                path = option_value(args, option)
                if path is None:
                    continue
                where = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
                assert where, f"{name}: {option}={path} is in no mounted volume"
                if option in SECRET_FILE_OPTIONS:
                    volume = mounts[where[0]]
                    assert "secret" in volume, f"{name}: {option}={path} is not from a Secret"
                    assert path != where[0], f"{name}: {option} names the mount, not a file"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_frontends_and_workers_share_one_plane_secret(overlay: str) -> None:
    secrets = set()
    for _, spec in pod_specs(render(overlay)):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in headwater_containers(spec):
            args = expanded_args(c)
            path = option_value(args, "--plane-secret-file")
            assert path, f"{c['name']}: no plane secret (a worker off loopback needs one)"
            mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
            secrets.add((volumes[mount["name"]]["secret"]["secretName"], path.rsplit("/", 1)[1]))
    assert secrets == {("headwater-plane-secret", "plane-secret")}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_advertise_their_pod_ip_and_register_in_etcd(overlay: str) -> None:
    services = {s["metadata"]["name"] for s in objects(overlay, "Service")}
    roles = set()
    for _, spec in pod_specs(render(overlay)):
        for c in headwater_containers(spec):
            args = parsed(c)
            assert args.discovery.startswith("etcd://")
            assert args.discovery.removeprefix("etcd://").split(":")[0] in services
            if c["args"][0] != "worker":
                continue
            roles.add(args.role)
            pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
            assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert "--advertise-host=$(POD_IP)" in c["args"]
            assert args.lease_ttl > 0
    assert roles in ({"agg"}, {"prefill", "decode"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_processes_auto_is_sized_by_the_cpu_limit(overlay: str, tmp_path: Path) -> None:
    """``--processes auto`` counts the container's CPU limit, which the kubelet writes as
    the cgroup's ``cpu.max`` (quota per 100 ms period): headwater/machine.py reads it."""
    for name, spec in pod_specs(render(overlay)):
        for c in headwater_containers(spec):
            if c["args"][0] != "serve":
                continue
            assert parsed(c).processes == 0, f"{name}: not --processes auto"
            limit = _cpus(c["resources"]["limits"]["cpu"])
            assert limit == int(limit) >= 1, f"{name}: a whole number of CPUs, one per process"
            (tmp_path / "pod").mkdir(exist_ok=True)
            (tmp_path / "pod" / "cpu.max").write_text(f"{int(limit * 100000)} 100000\n")
            (tmp_path / "cgroup").write_text("0::/pod\n")
            assert cgroup_cpu_limit(tmp_path, tmp_path / "cgroup") == limit


def _cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scrape_annotations_and_policies_name_real_ports(overlay: str) -> None:
    """Prometheus scrapes a port the pod has; the network policies' ports exist on the
    pods they select, and the workers' plane port admits only headwater's pods."""
    for workload in objects(overlay, "Deployment"):
        notes = workload["spec"]["template"]["metadata"]["annotations"]
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(notes["prometheus.io/port"]) in ports.values()
        assert notes["prometheus.io/path"] == "/metrics"
        if c["args"][0] == "worker":
            assert {"plane", "metrics"} <= set(ports)
    policy = next(p for p in objects(overlay, "NetworkPolicy") if "worker" in p["metadata"]["name"])
    plane, metrics = policy["spec"]["ingress"]
    assert plane["ports"] == [{"port": "plane"}]
    assert {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in plane["from"]
    } == {
        "frontend",
        "worker",
    }
    assert metrics["ports"] == [{"port": "metrics"}]
    assert (
        metrics["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_frontend_is_a_service_with_a_budget_and_an_autoscaler(overlay: str) -> None:
    (service,) = [s for s in objects(overlay, "Service") if s["metadata"]["name"] == "frontend"]
    (hpa,) = objects(overlay, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "frontend"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    budgets = {b["metadata"]["name"] for b in objects(overlay, "PodDisruptionBudget")}
    assert "frontend" in budgets
    (frontend,) = [d for d in objects(overlay, "Deployment") if d["metadata"]["name"] == "frontend"]
    labels = frontend["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
