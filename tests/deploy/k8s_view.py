"""A typed view of rendered kustomize overlays, for the manifest checks.

`kubectl kustomize` works offline (no API server needed). The view answers the questions the
manifest checks ask: which workloads exist, what labels their pods carry, which env values a
container really gets (envFrom ConfigMaps, Secret keys, downward API, `$(VAR)` expansion).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SECRET_TEMPLATE = K8S / "components" / "dev-secret" / "secret.yaml"


def template_secret(name: str) -> dict[str, Any]:
    """The Secret an overlay without one expects the operator to create (same keys)."""
    s = yaml.safe_load(SECRET_TEMPLATE.read_text())
    assert s["kind"] == "Secret" and s["metadata"]["name"] == name, SECRET_TEMPLATE
    return s
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())

# Values the downward API would give a pod; addresses only need to look like the real ones.
SAMPLE_POD_IP = "10.1.2.3"
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class EnvValue:
    """One env var of a container: its value as the pod would see it, and where it comes from."""

    value: str
    source: str  # "literal", "configmap:<name>", "secret:<name>/<key>", "field:<path>", ...


@dataclass
class Workload:
    """A Deployment or StatefulSet and its pod template."""

    kind: str
    name: str
    obj: dict[str, Any]
    replicas: int

    @property
    def pod_spec(self) -> dict[str, Any]:
        return self.obj["spec"]["template"]["spec"]

    @property
    def pod_labels(self) -> dict[str, str]:
        return self.obj["spec"]["template"]["metadata"].get("labels", {})

    @property
    def pod_annotations(self) -> dict[str, str]:
        return self.obj["spec"]["template"]["metadata"].get("annotations", {})

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.pod_spec["containers"]

    @property
    def service(self) -> str:
        """The TierCache service this workload runs (from `python -m services.<svc>`)."""
        (c,) = self.containers
        cmd = [*c.get("command", []), *c.get("args", [])]
        i = cmd.index("-m")
        return cmd[i + 1].removeprefix("services.")

    def pod_names(self) -> list[str]:
        if self.kind == "StatefulSet":
            return [f"{self.name}-{i}" for i in range(self.replicas)]
        return [f"{self.name}-0"]

    def container_ports(self, container: dict[str, Any]) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


@dataclass
class Rendered:
    """All objects of one rendered overlay."""

    overlay: str
    objects: list[dict[str, Any]]
    workloads: list[Workload] = field(default_factory=list)

    def __post_init__(self) -> None:
        for o in self.objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                self.workloads.append(Workload(o["kind"], o["metadata"]["name"], o,
                                               self._replicas(o)))

    def _replicas(self, obj: dict[str, Any]) -> int:
        if obj["kind"] == "Deployment":
            for hpa in self.of_kind("HorizontalPodAutoscaler"):
                ref = hpa["spec"]["scaleTargetRef"]
                if ref["kind"] == "Deployment" and ref["name"] == obj["metadata"]["name"]:
                    return hpa["spec"].get("minReplicas", 1)
        return obj["spec"].get("replicas", 1)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert found, f"{self.overlay}: no {kind}/{name}"
        return found[0]

    def workload_for(self, service: str) -> Workload:
        found = [w for w in self.workloads if w.service == service]
        assert len(found) == 1, f"{self.overlay}: expected one workload running {service}"
        return found[0]

    def selected(self, selector: dict[str, Any]) -> list[Workload]:
        """Workloads whose pods a label selector (matchLabels/matchExpressions or a plain map)
        selects."""
        return [w for w in self.workloads if selector_matches(selector, w.pod_labels)]

    def secret_data(self, name: str) -> dict[str, str]:
        """The Secret's values: the overlay's own (dev), else the template the operator
        fills in (components/dev-secret), which has the keys the pods read."""
        found = [o for o in self.of_kind("Secret") if o["metadata"]["name"] == name]
        s = found[0] if found else template_secret(name)
        assert not s.get("data"), "secrets are written as stringData so placeholders are visible"
        return dict(s.get("stringData", {}))

    def env(self, workload: Workload, container: dict[str, Any]) -> dict[str, EnvValue]:
        """The environment the container starts with (image ENV aside)."""
        out: dict[str, EnvValue] = {}
        for src in container.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                name = src["configMapRef"]["name"]
                for k, v in self.get("ConfigMap", name).get("data", {}).items():
                    out[prefix + k] = EnvValue(v, f"configmap:{name}")
            elif "secretRef" in src:
                name = src["secretRef"]["name"]
                for k, v in self.secret_data(name).items():
                    out[prefix + k] = EnvValue(v, f"secret:{name}/{k}")
        for e in container.get("env", []):
            if "value" in e:
                value = _VAR_REF.sub(lambda m: out[m.group(1)].value if m.group(1) in out
                                     else m.group(0), e["value"])
                out[e["name"]] = EnvValue(value, "literal")
                continue
            ref = e["valueFrom"]
            if "configMapKeyRef" in ref:
                r = ref["configMapKeyRef"]
                value = self.get("ConfigMap", r["name"])["data"][r["key"]]
                out[e["name"]] = EnvValue(value, f"configmap:{r['name']}")
            elif "secretKeyRef" in ref:
                r = ref["secretKeyRef"]
                data = self.secret_data(r["name"])
                assert r["key"] in data, f"{e['name']}: Secret {r['name']} has no key {r['key']}"
                out[e["name"]] = EnvValue(data[r["key"]], f"secret:{r['name']}/{r['key']}")
            elif "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                value = {"metadata.name": workload.pod_names()[0],
                         "metadata.namespace": workload.obj["metadata"].get("namespace", ""),
                         "status.podIP": SAMPLE_POD_IP}[path]
                out[e["name"]] = EnvValue(value, f"field:{path}")
            elif "resourceFieldRef" in ref:
                res = ref["resourceFieldRef"]["resource"]
                kind, _, name = res.partition(".")
                qty = container["resources"][kind][name]
                value = str(math.ceil(cpu_cores(qty))) if name == "cpu" else str(qty)
                out[e["name"]] = EnvValue(value, f"resource:{res}")
            else:  # pragma: no cover - a new kind of source needs a rule here
                raise AssertionError(f"unhandled env source {ref}")
        return out


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label selector semantics (an empty selector selects everything)."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        match_labels, exprs = selector, []
    else:
        match_labels, exprs = selector.get("matchLabels", {}), selector.get("matchExpressions", [])
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for ex in exprs:
        key, op, values = ex["key"], ex["operator"], ex.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def cpu_cores(qty: str | int | float) -> float:
    s = str(qty)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DEC = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def mem_bytes(qty: str | int) -> float:
    s = str(qty)
    for suffix, mult in (*_BIN.items(), *_DEC.items()):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    kustomize = shutil.which("kustomize")
    if kubectl:
        cmd = [kubectl, "kustomize", str(K8S / "overlays" / overlay)]
    elif kustomize:
        cmd = [kustomize, "build", str(K8S / "overlays" / overlay)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed: cannot render the overlays")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def tiercache_container(w: Workload) -> dict[str, Any]:
    """The container that runs the service (named after it)."""
    (c,) = [c for c in w.containers if c["name"] == w.service]
    return c


def resolve(r: Rendered, address: str) -> tuple[Workload, list[str], int]:
    """`host:port` inside the namespace -> (workload, pod names it reaches, port).

    Accepts `<svc>[.<ns>...]` (a Service) and `<pod>.<svc>[.<ns>...]` (one StatefulSet pod
    through its headless Service); the port must be a port of that Service.
    """
    host, _, port_s = address.rpartition(":")
    assert host and port_s.isdigit(), f"{address!r}: not host:port"
    port = int(port_s)
    parts = host.split(".")
    services = {s["metadata"]["name"]: s for s in r.of_kind("Service")}
    if len(parts) >= 2 and parts[1] in services and parts[0] not in services:
        pod, svc_name, rest = parts[0], parts[1], parts[2:]
    else:
        pod, svc_name, rest = None, parts[0], parts[1:]
    assert svc_name in services, f"{address!r}: no Service {svc_name!r}"
    svc = services[svc_name]
    ns = svc["metadata"]["namespace"]
    if rest:
        assert rest[0] == ns, f"{address!r}: namespace {rest[0]!r}, the Service is in {ns!r}"
    (w,) = r.selected(svc["spec"]["selector"]) or [None]
    assert w is not None, f"{address!r}: Service {svc_name} selects no pods"
    ports = {p["port"]: p for p in svc["spec"]["ports"]}
    assert port in ports, f"{address!r}: Service {svc_name} exposes {sorted(ports)}"
    if pod is None:
        return w, w.pod_names(), port
    assert svc["spec"].get("clusterIP") == "None", f"{address!r}: {svc_name} is not headless"
    assert w.kind == "StatefulSet" and w.obj["spec"]["serviceName"] == svc_name, (
        f"{address!r}: pod DNS names need a StatefulSet whose serviceName is {svc_name}")
    assert pod in w.pod_names(), f"{address!r}: {w.name} has pods {w.pod_names()}"
    return w, [pod], port


def shared_env_names() -> set[str]:
    """`TIERCACHE_*` names that code under services/ reads directly (not via a config class)."""
    pat = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\()\s*["'](TIERCACHE_[A-Z0-9_]+)""")
    names: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        names.update(pat.findall(path.read_text(encoding="utf-8")))
    return names
