"""What must hold in every rendered overlay for TierCache to start and talk to itself.

Rendered with `kubectl kustomize`, then checked the way a cluster would use the objects: probes
and resources on every container, Services that select pods that exist, ports that agree between
Services, probes, annotations and the services' own config, env names that the services really
read (against their config dataclasses), addresses that point at pods that exist, and
NetworkPolicies evaluated pair by pair.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from services.common.addresses import shard_fingerprint
from services.common.bootstrap import HEALTH_PATH, READY_PATH
from services.common.config import ConfigError, env_name, load_config
from tests.deploy.k8s_view import (
    ROOT,
    SAMPLE_POD_IP,
    EnvValue,
    Rendered,
    Workload,
    cpu_cores,
    mem_bytes,
    resolve,
    selector_matches,
    shared_env_names,
    tiercache_container,
)

SERVICES = ("orchestrator", "semantic", "prefix", "kvpool")
# Convention (DESIGN.md / STYLE.md): gRPC and metrics port of each service.
PORTS = {"orchestrator": (50051, 9101), "semantic": (50052, 9102), "prefix": (50053, 9103),
         "kvpool": (50054, 9104)}
# Who may call whom on the gRPC port (besides anyone -> orchestrator).
INTERNAL_CALLS = {("orchestrator", "semantic"), ("orchestrator", "prefix"),
                  ("orchestrator", "kvpool"), ("kvpool", "prefix")}
# Minimum startup budget (periodSeconds x failureThreshold): model loads are slow on a cold node.
# semantic: re-embedding the 200,000-entry cap after a change of embedding model takes 16 min
# (short prompts, 208/s) to 1.8 h (150-250 words, 31/s) on 2 cores before it serves.
MIN_STARTUP_S = {"orchestrator": 120, "semantic": 6480, "prefix": 60, "kvpool": 600}
# Measured peaks the base requests cover (docs/deploy.md "Memory", docs/capacity.md): kvpool
# 4.4 GiB with a long prompt at the base's 4,096-token context, semantic ~1.6 GiB while a
# restart rebuilds 200,000 entries. The dev overlay's smaller settings have smaller peaks.
MEMORY_PEAK = {"kvpool": int(4.4 * 2**30), "semantic": int(1.6 * 2**30)}
# The drain time used when a config has no such field (services.common.bootstrap default).
DEFAULT_GRACE_S = 10.0
GRACE_FIELDS = ("grace_s", "grace_seconds", "drain_s", "drain_seconds")
K8S_VERSION = "1.37.0"


# ------------------------------------------------------------------------------------ helpers


def config_class(svc: str) -> type:
    """The `*Config` dataclass of `services/<svc>/config.py`."""
    mod = importlib.import_module(f"services.{svc}.config")
    found = [obj for name, obj in vars(mod).items()
             if name.endswith("Config") and isinstance(obj, type)
             and dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__]
    assert len(found) == 1, f"services/{svc}/config.py: expected one *Config dataclass: {found}"
    return found[0]


def service_env(r: Rendered, w: Workload) -> dict[str, EnvValue]:
    return r.env(w, tiercache_container(w))


def load_service_config(r: Rendered, w: Workload) -> Any:
    """The workload's config exactly as `python -m services.<svc>` would build it."""
    cls = config_class(w.service)
    environ = {k: v.value for k, v in service_env(r, w).items()}
    try:
        return load_config(cls, w.service, [], environ=environ)
    except ConfigError as exc:
        pytest.fail(f"{r.overlay}/{w.name}: the rendered env does not load: {exc}")


def grpc_port(w: Workload) -> int:
    return w.container_ports(tiercache_container(w))["grpc"]


def metrics_port(w: Workload) -> int:
    return w.container_ports(tiercache_container(w))["metrics"]


# ------------------------------------------------------------------------------------ tests


def test_overlays_render_every_service(rendered: Rendered) -> None:
    assert sorted(w.service for w in rendered.workloads) == sorted(SERVICES)
    kinds = {w.service: w.kind for w in rendered.workloads}
    assert kinds["orchestrator"] == "Deployment"
    assert kinds["kvpool"] == "StatefulSet"  # the pod name is the replica id
    assert kinds["semantic"] == "StatefulSet"  # a PVC per shard
    for kind in ("ServiceAccount", "Service", "PodDisruptionBudget", "NetworkPolicy",
                 "ConfigMap", "HorizontalPodAutoscaler"):  # the Secret: see below
        assert rendered.of_kind(kind), f"{rendered.overlay}: no {kind}"


def test_every_object_and_volume_claim_is_labelled_part_of_tiercache(rendered: Rendered
                                                                      ) -> None:
    """Every object carries `app.kubernetes.io/part-of=tiercache` (the docs select by it); the dev
    overlay's volume patch replaced the semantic claim template's labels and left it out."""
    for o in rendered.objects:
        if o["kind"] == "Namespace":
            continue
        name = f"{rendered.overlay}: {o['kind']}/{o['metadata']['name']}"
        assert o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "tiercache", \
            name
        for t in o.get("spec", {}).get("volumeClaimTemplates", []):
            labels = t["metadata"].get("labels", {})
            assert labels.get("app.kubernetes.io/part-of") == "tiercache", \
                f"{name} claim {t['metadata']['name']}"


def test_manifests_validate_strictly_against_current_kubernetes(rendered: Rendered) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils")
    errors = []
    for obj in rendered.objects:
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            errors.append(exc.message)
    assert not errors, "\n".join(errors)


def test_every_container_has_probes_resources_and_runs_locked_down(rendered: Rendered) -> None:
    for w in rendered.workloads:
        spec = w.pod_spec
        assert spec["securityContext"]["runAsNonRoot"] is True, w.name
        assert spec.get("automountServiceAccountToken") is False, w.name
        assert spec["serviceAccountName"] == w.name
        rendered.get("ServiceAccount", spec["serviceAccountName"])
        for c in [*spec.get("initContainers", []), *w.containers]:
            where = f"{rendered.overlay}/{w.name}/{c['name']}"
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    assert r in res.get(kind, {}), f"{where}: no {kind}.{r}"
            assert cpu_cores(res["requests"]["cpu"]) <= cpu_cores(res["limits"]["cpu"]), where
            assert (mem_bytes(res["requests"]["memory"])
                    <= mem_bytes(res["limits"]["memory"])), where
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
        for c in w.containers:
            where = f"{rendered.overlay}/{w.name}/{c['name']}"
            ports = w.container_ports(c)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{where}: no {probe}"
            # Startup: native gRPC health on the service's own port (gRPC serves). Readiness and
            # liveness: the same status over HTTP on the metrics port, which a flood filling
            # the gRPC server's call cap cannot refuse (a busy pod is neither taken out of its
            # Service nor restarted).
            assert c["startupProbe"].get("grpc", {}).get("port") == ports["grpc"], where
            # The orchestrator's readiness also needs a healthy replica on its model (READY_PATH):
            # ready without one, a rolling update to a model no replica served yet replaced
            # every working pod. Liveness never waits on another tier.
            paths = {"readinessProbe": READY_PATH if w.service == "orchestrator" else HEALTH_PATH,
                     "livenessProbe": HEALTH_PATH}
            for probe in ("readinessProbe", "livenessProbe"):
                get = c[probe].get("httpGet", {})
                assert get.get("path") == paths[probe], f"{where}: {probe}"
                port = get.get("port")  # a container port's name or number
                assert ports.get(port, port) == ports["metrics"], f"{where}: {probe}"
            start = c["startupProbe"]
            budget = start.get("periodSeconds", 10) * start.get("failureThreshold", 3)
            assert budget >= MIN_STARTUP_S[w.service], (
                f"{where}: startup budget {budget}s is shorter than a cold model load")
            for probe in ("startupProbe", "readinessProbe"):
                # The 1 s default: a pod busy on its CPU limit (torch threads, the GIL) missed
                # two checks and left the Service's endpoints while serving.
                assert c[probe].get("timeoutSeconds", 1) >= 3, f"{where}: {probe} timeout"
            if w.service in MEMORY_PEAK and rendered.overlay != "dev":
                # Requested near the measured peak: a pod over its request is among the first
                # the kubelet evicts under node memory pressure.
                assert mem_bytes(res["requests"]["memory"]) >= MEMORY_PEAK[w.service], where


def test_services_pdbs_hpas_and_policies_select_existing_pods(rendered: Rendered) -> None:
    for svc in rendered.of_kind("Service"):
        name = svc["metadata"]["name"]
        selected = rendered.selected(svc["spec"]["selector"])
        assert len(selected) == 1, f"{rendered.overlay}: Service {name} selects {selected}"
        (w,) = selected
        ports = w.container_ports(tiercache_container(w))
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            number = ports.get(target) if isinstance(target, str) else target
            assert number in ports.values(), f"Service {name}: targetPort {target} not on pods"
            assert p["port"] == number, f"Service {name}: port {p['port']} -> {number}"
    for w in rendered.workloads:
        if w.kind == "StatefulSet":
            headless = rendered.get("Service", w.obj["spec"]["serviceName"])
            assert headless["spec"].get("clusterIP") == "None", w.name
            assert rendered.selected(headless["spec"]["selector"]) == [w]
        assert selector_matches(w.obj["spec"]["selector"], w.pod_labels), w.name
        pdbs = [p for p in rendered.of_kind("PodDisruptionBudget")
                if rendered.selected(p["spec"]["selector"]) == [w]]
        assert len(pdbs) == 1, f"{rendered.overlay}/{w.name}: PDBs {pdbs}"
        pdb = pdbs[0]["spec"]
        # A budget of zero disruptions would block every node drain.
        assert pdb.get("maxUnavailable", 1) >= 1 or pdb.get("minAvailable", 0) < w.replicas
    for hpa in rendered.of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = rendered.get(ref["kind"], ref["name"])
        assert "replicas" not in target["spec"], "the HPA owns the replica count"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for np in rendered.of_kind("NetworkPolicy"):
        sel = np["spec"]["podSelector"]
        assert sel == {} or rendered.selected(sel), f"{np['metadata']['name']} selects nothing"


def test_ports_agree_between_config_pods_probes_and_scrape_annotations(
        rendered: Rendered) -> None:
    for w in rendered.workloads:
        where = f"{rendered.overlay}/{w.name}"
        grpc, metrics = PORTS[w.service]
        assert grpc_port(w) == grpc and metrics_port(w) == metrics, where
        env = service_env(rendered, w)
        # The default address is loopback: a pod must listen on all interfaces.
        addr = env[env_name(w.service, "address")].value
        assert addr == f"0.0.0.0:{grpc}", f"{where}: address {addr}"
        assert env[env_name(w.service, "metrics_port")].value == str(metrics), where
        ann = w.pod_annotations
        assert ann.get("prometheus.io/scrape") == "true", where
        assert ann.get("prometheus.io/port") == str(metrics), where
        assert ann.get("prometheus.io/path") == "/metrics", where
        cfg = load_service_config(rendered, w)
        assert cfg.address.endswith(f":{grpc}") and cfg.metrics_port == metrics, where


@pytest.mark.parametrize("svc", SERVICES)
def test_env_names_match_what_the_service_reads(rendered: Rendered, svc: str) -> None:
    w = rendered.workload_for(svc)
    env = service_env(rendered, w)
    names = {n for n in env if n.startswith("TIERCACHE_")}
    others = [n for n in names for o in SERVICES
              if o != svc and n.startswith(f"TIERCACHE_{o.upper()}_")]
    assert not others, f"{rendered.overlay}/{w.name} gets another service's settings: {others}"
    own = {n for n in names if n.startswith(f"TIERCACHE_{svc.upper()}_")}
    shared = names - own
    unread = shared - shared_env_names()
    assert not unread, f"{rendered.overlay}/{w.name}: no code under services/ reads {unread}"
    cls = config_class(svc)
    fields = {env_name(svc, f.name) for f in dataclasses.fields(cls)}
    unknown = own - fields
    assert not unknown, (f"{rendered.overlay}/{w.name}: {cls.__name__} has no field for "
                         f"{sorted(unknown)}")
    # Values parse as the fields' types and pass the config's own validate().
    assert load_service_config(rendered, w) is not None


def test_addresses_point_at_every_pod_of_the_right_service(rendered: Rendered) -> None:
    for w in rendered.workloads:
        cls = config_class(w.service)
        env = service_env(rendered, w)
        fields = ([f.name for f in dataclasses.fields(cls)] if cls else
                  [n.removeprefix(f"TIERCACHE_{w.service.upper()}_").lower() for n in env])
        for f in fields:
            if f in ("address", "advertise_address") or not f.endswith(("_address", "_addresses")):
                continue
            target = f.rsplit("_", 1)[0]
            assert target in SERVICES, f"{w.name}: {f} names no TierCache service"
            raw = env.get(env_name(w.service, f))
            values = [a.strip() for a in raw.value.split(",") if a.strip()] if raw else []
            reached: list[str] = []
            for address in values:
                tw, pods, port = resolve(rendered, address)
                assert tw.service == target, f"{w.name}: {f}={address} reaches {tw.service}"
                assert port == grpc_port(tw), f"{w.name}: {f}={address}: port"
                # A caller counts each address as one replica or shard. A StatefulSet's
                # headless Service name (`kvpool:50054`) resolves to every pod: one "replica"
                # that is any pod, all traffic on the first IP gRPC picks, yet it "reached"
                # every pod here, so gpu's 4 replicas listed that way passed.
                assert len(pods) == 1, (
                    f"{rendered.overlay}/{w.name}: {f}={address} names {tw.name}'s headless "
                    f"Service, not one pod: list each as <pod>.{tw.name}:{port}")
                reached += pods
            tw = rendered.workload_for(target)
            # Every shard/replica must be listed, once, or part of the tier is never used.
            assert sorted(reached) == sorted(tw.pod_names()), (
                f"{rendered.overlay}/{w.name}: {env_name(w.service, f)} reaches {reached}, "
                f"{tw.name} runs {tw.pod_names()}")


def test_kvpool_identity_comes_from_the_downward_api(rendered: Rendered) -> None:
    w = rendered.workload_for("kvpool")
    env = service_env(rendered, w)
    replica = env[env_name("kvpool", "replica_id")]
    assert replica.value == w.pod_names()[0]
    adv = env[env_name("kvpool", "advertise_address")]
    assert adv.value == f"{SAMPLE_POD_IP}:{grpc_port(w)}"
    cfg = load_service_config(rendered, w)
    assert cfg.replica_id == w.pod_names()[0]
    assert cfg.public_address == adv.value


def test_shared_settings_agree_across_services(rendered: Rendered) -> None:
    envs = {svc: service_env(rendered, rendered.workload_for(svc)) for svc in SERVICES}
    # One block-hash key for everything that hashes blocks, from the Secret.
    keys = {envs[s]["TIERCACHE_HASH_KEY"].source for s in ("orchestrator", "prefix", "kvpool")}
    assert len(keys) == 1 and next(iter(keys)).startswith("secret:"), keys
    tokens = {envs[s][env_name(s, "internal_token")].source for s in SERVICES}
    assert len(tokens) == 1 and next(iter(tokens)).startswith("secret:"), tokens
    # The orchestrator tokenizes for the replicas' model, with the same block size.
    cfgs = {s: load_service_config(rendered, rendered.workload_for(s)) for s in SERVICES}
    orch, kv = cfgs["orchestrator"], cfgs["kvpool"]
    if orch is not None and kv is not None:
        assert orch.model == kv.model and orch.block_size == kv.block_size
    for s in SERVICES:
        if cfgs[s] is not None and hasattr(cfgs[s], "block_size") and kv is not None:
            assert cfgs[s].block_size == kv.block_size, s
    # Both sides place a chain on a prefix shard by a ring of their own list: two names for
    # one pod (`prefix-0.prefix` and `prefix-0.prefix.tiercache`) both reach prefix-0 above,
    # yet are two shards to the ring, and replicas publish where Matches never look.
    lists = {"orchestrator": orch.prefix_addresses, "kvpool": kv.prefix_address.split(",")}
    prints = {s: shard_fingerprint(a) for s, a in lists.items()}
    assert len(set(prints.values())) == 1, f"{rendered.overlay}: prefix shard lists {lists}"


SNAPSHOT_SAVE_S = 10.0


def test_termination_grace_outlasts_the_drain(rendered: Rendered) -> None:
    for w in rendered.workloads:
        cfg = load_service_config(rendered, w)
        grace = next((float(getattr(cfg, f)) for f in GRACE_FIELDS if hasattr(cfg, f)),
                     DEFAULT_GRACE_S)
        env = service_env(rendered, w)
        # Health goes NOT_SERVING first; requests are still served this long before the drain.
        delay = float(env["TIERCACHE_DRAIN_DELAY_S"].value) if "TIERCACHE_DRAIN_DELAY_S" in env \
            else 0.0
        assert delay > 0, f"{rendered.overlay}/{w.name}: no TIERCACHE_DRAIN_DELAY_S"
        # The semantic service then waits this long for a running index merge, and saves its
        # HNSW graphs (0.2 s for 100k entries, 173 MB, on local disk:
        # benchmarks/results/semantic_restart.json; a slow volume's fsync allowed for).
        close = float(getattr(cfg, "index_close_seconds", 0.0))
        save = SNAPSHOT_SAVE_S if getattr(cfg, "snapshot_on_stop", False) else 0.0
        tgps = w.pod_spec["terminationGracePeriodSeconds"]
        assert tgps >= delay + grace + close + save + 5, (
            f"{rendered.overlay}/{w.name}: {tgps}s grace, {delay}s delay + drain {grace}s + "
            f"index close {close}s + snapshot save {save}s")


# What one entry holds on a semantic PersistentVolume at most (docs/capacity.md §1): its SQLite
# row (one 4 KiB page from ~410 characters of question + answer) and, in namespaces past
# hnsw_min_entries, its vector in the saved HNSW graphs (~1.8 KB), twice while a save writes the
# new files before removing the old; plus the ONNX export of the embedding model (87 MB).
SEMANTIC_PV_BYTES_PER_ENTRY = 4150 + 2 * 1800
ONNX_EXPORT_BYTES = 87e6


def test_the_semantic_volume_holds_the_entry_cap_with_its_saved_graphs(rendered: Rendered
                                                                        ) -> None:
    """dev's 2Gi claim was sized from SQLite and the export alone; the graphs a stop (and every
    snapshot_interval_s) saves beside the database live on the same volume."""
    w = rendered.workload_for("semantic")
    cfg = load_service_config(rendered, w)
    claim = next(t for t in w.obj["spec"]["volumeClaimTemplates"]
                 if t["metadata"]["name"] == "data")
    need = cfg.max_entries_total * SEMANTIC_PV_BYTES_PER_ENTRY + ONNX_EXPORT_BYTES
    have = mem_bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert have >= need, f"{rendered.overlay}: {have / 1e9:.2f} GB claimed, {need / 1e9:.2f} needed"


def test_the_orchestrator_drains_as_long_as_the_replicas_it_streams_from(rendered: Rendered
                                                                           ) -> None:
    """Its drain was 30 s against the replicas' 60 s: a rollout of the orchestrator cut the
    answers the replicas would have finished (the public API cannot resume a stream)."""
    cfg = {s: load_service_config(rendered, rendered.workload_for(s))
           for s in ("orchestrator", "kvpool")}
    assert cfg["orchestrator"].grace_s >= cfg["kvpool"].grace_seconds


def _peer_matches(peer: dict[str, Any], src: dict[str, Any], ns: str) -> bool:
    assert "ipBlock" not in peer, "ipBlock peers are not modelled by this test"
    ns_ok = (selector_matches(peer["namespaceSelector"], src["ns_labels"])
             if "namespaceSelector" in peer else src["ns"] == ns)
    pod_ok = selector_matches(peer["podSelector"], src["labels"]) if "podSelector" in peer else True
    return ns_ok and pod_ok


def _port_matches(rule_ports: list[dict[str, Any]] | None, dst: Workload, port: int) -> bool:
    if not rule_ports:
        return True
    named = dst.container_ports(tiercache_container(dst))
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None:
            return True
        lo = named.get(want) if isinstance(want, str) else want
        if lo is not None and lo <= port <= p.get("endPort", lo):
            return True
    return False


def ingress_allowed(r: Rendered, src: dict[str, Any], dst: Workload, port: int) -> bool:
    """NetworkPolicy semantics: isolated once any Ingress policy selects the pod; then allowed
    only if some rule of some selecting policy admits the peer on the port."""
    ns = dst.obj["metadata"]["namespace"]
    policies = [p["spec"] for p in r.of_kind("NetworkPolicy")
                if p["metadata"]["namespace"] == ns
                and selector_matches(p["spec"]["podSelector"], dst.pod_labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for spec in policies:
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            if (not peers or any(_peer_matches(p, src, ns) for p in peers)) and \
                    _port_matches(rule.get("ports"), dst, port):
                return True
    return False


def test_network_policies_admit_exactly_the_intended_traffic(rendered: Rendered) -> None:
    ns = rendered.workloads[0].obj["metadata"]["namespace"]
    sources = [{"name": w.service, "ns": ns, "labels": w.pod_labels,
                "ns_labels": {"kubernetes.io/metadata.name": ns}} for w in rendered.workloads]
    sources += [
        {"name": "outside", "ns": "default", "labels": {"app": "client"},
         "ns_labels": {"kubernetes.io/metadata.name": "default"}},
        {"name": "monitoring", "ns": "monitoring", "labels": {"app": "prometheus"},
         "ns_labels": {"kubernetes.io/metadata.name": "monitoring"}},
    ]
    allowed, expected = set(), set()
    for src in sources:
        for dst in rendered.workloads:
            for kind, port in (("grpc", grpc_port(dst)), ("metrics", metrics_port(dst))):
                key = (src["name"], dst.service, kind)
                if ingress_allowed(rendered, src, dst, port):
                    allowed.add(key)
                if (kind == "grpc" and (dst.service == "orchestrator"
                                        or (src["name"], dst.service) in INTERNAL_CALLS)) or \
                        (kind == "metrics" and src["name"] == "monitoring"):
                    expected.add(key)
    assert allowed == expected, (f"{rendered.overlay}: unexpectedly allowed "
                                 f"{sorted(allowed - expected)}, blocked "
                                 f"{sorted(expected - allowed)}")


def test_only_the_dev_overlay_ships_a_secret(rendered: Rendered) -> None:
    """A Secret in an overlay is written back on every `kubectl apply -k`: the operator's real
    hash key and tokens would be reset to the public placeholders (and the placeholder admin
    token would work). Only the laptop overlay carries one."""
    names = [o["metadata"]["name"] for o in rendered.of_kind("Secret")]
    assert names == (["tiercache-secrets"] if rendered.overlay == "dev" else []), names


def test_secret_holds_clearly_marked_placeholders_that_parse(rendered: Rendered) -> None:
    data = rendered.secret_data("tiercache-secrets")
    assert set(data) == {"hash-key", "internal-token", "tenant-tokens.json"}
    assert all("PLACEHOLDER" in v for v in data.values()), "placeholders must be obvious"
    assert len(data["hash-key"].encode()) <= 64  # TIERCACHE_HASH_KEY limit (hashing.py)
    tokens = json.loads(data["tenant-tokens.json"])
    assert tokens and all("tenant" in spec for spec in tokens.values())
    # One ordinary tenant (listed first) and one operator who may read cluster-wide Stats.
    assert [bool(spec.get("admin")) for spec in tokens.values()] == [False, True]
    w = rendered.workload_for("orchestrator")
    cfg = load_service_config(rendered, w)
    path = service_env(rendered, w)[env_name("orchestrator", "tokens_file")].value
    mounts = {m["name"]: m["mountPath"] for m in tiercache_container(w)["volumeMounts"]}
    vols = {v["name"]: v for v in w.pod_spec["volumes"]}
    hits = [(mounts[n], item) for n, v in vols.items() if "secret" in v and n in mounts
            for item in v["secret"].get("items", [])
            if v["secret"]["secretName"] == "tiercache-secrets"
            and f"{mounts[n]}/{item['path']}" == path]
    assert hits and hits[0][1]["key"] == "tenant-tokens.json", f"{path} is not the mounted file"
    assert cfg.tokens_file == path


def test_dev_overlay_is_cpu_only_with_one_pod_per_tier(dev: Rendered) -> None:
    for w in dev.workloads:
        assert w.replicas == 1, w.name
        for c in w.containers:
            assert not any("nvidia.com" in k for k in c["resources"]["limits"]), w.name
    env = service_env(dev, dev.workload_for("kvpool"))
    assert env[env_name("kvpool", "device")].value == "cpu"
    # The small packaged model, converted into the image at build time (see test_image.py).
    assert env[env_name("kvpool", "model")].value.endswith("/SmolLM2-135M-Instruct")


def test_gpu_overlay_gives_each_kvpool_pod_one_gpu(gpu: Rendered, dev: Rendered) -> None:
    w = gpu.workload_for("kvpool")
    c = tiercache_container(w)
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    # No nodeSelector on Feature Discovery's gpu.present: the GPU request places the pod,
    # and only the memory rule (tested below) needs that label.
    assert "nodeSelector" not in w.pod_spec
    assert any(t["key"] == "nvidia.com/gpu" for t in w.pod_spec["tolerations"])
    env = service_env(gpu, w)
    assert env[env_name("kvpool", "device")].value.startswith("cuda")
    assert w.replicas > dev.workload_for("kvpool").replicas
    assert gpu.workload_for("orchestrator").replicas > 1
    assert all(tiercache_container(x)["image"].endswith("-cuda") for x in gpu.workloads)


def test_docs_cover_the_operations(all_rendered: dict[str, Rendered]) -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    for must in ("docker build", "docker push", "kubectl apply -k", "scale statefulset",
                 "port-forward", "grpcurl", "make k8s-validate", "shard"):
        assert must in doc, f"docs/deploy.md does not mention {must!r}"
    assert Path(ROOT / "deploy" / "k8s" / "base" / "kustomization.yaml").exists()


def test_gpu_overlay_schedules_kvpool_only_on_gpus_its_pool_fits(gpu: Rendered) -> None:
    # The pool (TIERCACHE_KVPOOL_KV_CACHE_BYTES) + the working rows (max batch x max context
    # tokens; 1.5x that while growing by doubling, unless allocated at start) + SmolLM2's bf16
    # weights must fit the smallest GPU the pod may land on (GPU feature discovery's
    # nvidia.com/gpu.memory label, MiB): on a 16 GB card it would fail at start with CUDA out
    # of memory, and on a 20 GB card at the first long batch if the rows grew.
    import torch

    from services.kvpool.paged_cache import KvStore

    w = gpu.workload_for("kvpool")
    env = service_env(gpu, w)
    terms = w.pod_spec["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    floors = []
    for term in terms:  # the pod may land on a node matching any term: each needs a floor
        (floor,) = [int(e["values"][0]) for e in term["matchExpressions"]
                    if e["key"] == "nvidia.com/gpu.memory" and e["operator"] == "Gt"]
        floors.append(floor)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; bf16.
    per_token = KvStore.block_bytes(30, 3, 64, 1, torch.bfloat16)
    assert env[env_name("kvpool", "dtype")].value == "bfloat16"
    assert int(env[env_name("kvpool", "num_blocks")].value) == 0  # sized in bytes
    pool = int(env[env_name("kvpool", "kv_cache_bytes")].value)
    rows = (int(env[env_name("kvpool", "max_batch_size")].value)
            * int(env[env_name("kvpool", "max_context")].value) * per_token)
    prealloc = env.get(env_name("kvpool", "preallocate_rows"))
    if not (prealloc and prealloc.value.lower() in ("1", "true", "yes", "on")):
        rows *= 1.5  # old and new rows held at once while the last doubling copies
    weights = 135e6 * 2
    cuda_context = 0.5 * 2**30
    assert min(floors) * 2**20 >= pool + rows + weights + cuda_context, (
        f"GPUs of {min(floors)} MiB admitted for {(pool + rows + weights) / 2**20:.0f} MiB")


def _doc_kubectl_commands() -> list[list[str]]:
    """Every `kubectl` command of docs/deploy.md: its shell blocks' lines (continuations
    joined; a pipeline split at each `|`) and its inline code, as one line each."""
    doc = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    pieces: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", doc, re.S):
        pieces += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", doc, flags=re.S)
    pieces += [" ".join(m.split()) for m in re.findall(r"`([^`]+)`", prose)]
    found: list[list[str]] = []
    for piece in pieces:
        if "kubectl" not in piece:  # (a log line's format in inline code need not parse)
            continue
        lex = shlex.shlex(piece, posix=True, punctuation_chars="|&;()")
        lex.whitespace_split = True
        words: list[str] = []
        for tok in [*lex, "|"]:
            if tok and set(tok) <= set("|&;()"):
                if words[:1] == ["kubectl"] and not any("<" in w for w in words):
                    found.append(words)
                words = []
            else:
                words.append(tok)
    return found


def test_deploy_doc_commands_name_what_the_overlays_make(
        all_rendered: dict[str, Rendered]) -> None:
    """An operator pastes these: each namespace, object, pod, label, port and overlay they
    name must exist. `kubectl logs statefulset/kvpool | grep <request id>` read one replica's
    pod of four (the gpu overlay's), and a selector alone reads 10 lines of each pod."""
    commands = _doc_kubectl_commands()
    assert len(commands) >= 15, commands
    kinds = {"deployment": "Deployment", "statefulset": "StatefulSet", "svc": "Service",
             "hpa": "HorizontalPodAutoscaler", "secret": "Secret", "pod": "Pod"}
    for words in commands:
        cmd = " ".join(words)
        for r in all_rendered.values():
            ns = {o["metadata"]["namespace"] for o in r.objects if o["kind"] != "Namespace"}
            if "-n" in words:
                assert {words[words.index("-n") + 1]} == ns, cmd
            pods = {p: w for w in r.workloads for p in w.pod_names()}
            for i, word in enumerate(words):
                m = re.fullmatch(r"([a-z]+)/([a-z0-9-]+)", word)
                if m and m.group(1) in kinds:
                    assert _exists(r, kinds[m.group(1)], m.group(2)), f"{r.overlay}: {cmd}"
                elif word in kinds and i + 1 < len(words) and i >= 2 and \
                        words[i - 1] in ("patch", "get", "generic"):
                    assert _exists(r, kinds[word], words[i + 1]), f"{r.overlay}: {cmd}"
                elif word in ("-k", "-l") and i + 1 < len(words):
                    arg = words[i + 1]
                    if word == "-k":
                        assert (ROOT / arg / "kustomization.yaml").exists(), cmd
                    else:
                        key, _, value = arg.partition("=")
                        assert any(o["metadata"].get("labels", {}).get(key) == value
                                   for o in r.objects), f"{r.overlay}: {cmd}"
            args = words[words.index("port-forward") + 1:] if "port-forward" in words else []
            if len(args) >= 2:  # the prose's bare `kubectl port-forward` names nothing
                target, ports = args[:2]
                kind, name = target.split("/")
                remote = int(ports.split(":")[1])
                if kind == "svc":
                    svc = r.get("Service", name)
                    assert remote in [p["port"] for p in svc["spec"]["ports"]], cmd
                else:
                    w = pods[name]
                    assert remote in w.container_ports(tiercache_container(w)).values(), cmd
            if "logs" in words:
                # Every pod of the workload, whole: a selector, and --tail=-1 (its default
                # with a selector is 10 lines per pod).
                assert "-l" in words and "--tail=-1" in words, cmd
                sel = dict([words[words.index("-l") + 1].split("=", 1)])
                assert rendered_pods(r, sel), cmd


def rendered_pods(r: Rendered, labels: dict[str, str]) -> list[str]:
    return [p for w in r.selected(labels) for p in w.pod_names()]


def _exists(r: Rendered, kind: str, name: str) -> bool:
    """Whether the overlay makes `kind`/`name` (a Pod: a workload's pod name)."""
    if kind == "Pod":
        return any(name in w.pod_names() for w in r.workloads)
    if kind == "Secret":  # the operator's (only dev ships one): the name the pods read
        return name == "tiercache-secrets"
    return any(o["metadata"]["name"] == name for o in r.of_kind(kind))


def test_deploy_doc_names_every_tier_a_node_drain_may_take_whole(
        all_rendered: dict[str, Rendered]) -> None:
    """Every PDB allows one pod down, so a tier running one pod is out for a whole reschedule
    during a drain. The doc named semantic, prefix and dev's kvpool, not dev's orchestrator
    (its HPA at 1)."""
    doc = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    start = doc.index("Every PodDisruptionBudget is")
    para = " ".join(doc[start:doc.index("\n\n", start)].split())
    for r in all_rendered.values():
        for pdb in r.of_kind("PodDisruptionBudget"):
            assert pdb["spec"].get("maxUnavailable") == 1, pdb["metadata"]["name"]
        for w in r.workloads:
            if w.replicas == 1:
                assert w.service in para, f"{r.overlay}: one {w.service} pod, not in: {para}"


def _spreads_over_nodes(w: Workload) -> bool:
    """A hostname topology spread (or pod anti-affinity) term selecting this workload's pods."""
    spec = w.pod_spec
    terms = [(t["topologyKey"], t.get("labelSelector", {}))
             for t in spec.get("topologySpreadConstraints", [])]
    anti = spec.get("affinity", {}).get("podAntiAffinity", {})
    terms += [(t["topologyKey"], t.get("labelSelector", {}))
              for t in anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])]
    terms += [(t["podAffinityTerm"]["topologyKey"], t["podAffinityTerm"].get("labelSelector", {}))
              for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    return any(key == "kubernetes.io/hostname" and sel and selector_matches(sel, w.pod_labels)
               for key, sel in terms)


def test_every_workload_spreads_its_pods_over_nodes(rendered: Rendered) -> None:
    """semantic and prefix had no spread: their shards (docs: "run two shards where that tier
    must stay up") could all land on one node, and that node's failure took the whole tier."""
    crowded = [w.name for w in rendered.workloads if not _spreads_over_nodes(w)]
    assert not crowded, f"{rendered.overlay}: no spread over nodes for {crowded}"


def test_pod_names_resolve_while_the_pod_loads(rendered: Rendered) -> None:
    """Callers dial each replica and shard by its pod name (`kvpool-0.kvpool`) and judge its
    health themselves. A headless Service publishes those names only for ready pods, so a pod
    loading its model had none, and gRPC, after failing to resolve it, re-resolves on a
    backoff growing to 2 minutes: a name absent for 120 s was reached 70 s after it resolved
    (a channel with the services' options, GRPC_DNS_RESOLVER=native), 1-2 minutes more of a
    restarted dev replica's orchestrator not ready. Published at once, the orchestrator
    connects while the pod loads and sees it SERVING within a poll."""
    for w in rendered.workloads:
        if w.kind != "StatefulSet":
            continue
        svc = rendered.get("Service", w.obj["spec"]["serviceName"])
        assert svc["spec"].get("publishNotReadyAddresses") is True, (
            f"{rendered.overlay}: Service {svc['metadata']['name']} publishes {w.name}'s pod "
            f"names only once ready")
