"""The dev overlay's rendered settings really start TierCache and serve a tenant.

No cluster here, so the pods are played by local processes that get exactly the environment the
rendered manifests give each container (ConfigMaps, Secret keys, downward API), with what a
cluster would provide mapped onto this machine:

- a Service/pod DNS name and port -> 127.0.0.1 and a free port of the process playing that pod;
- a volume mount path -> a temporary directory (Secret volumes get their files written);
- the model folder baked into the image -> the same folder converted locally;
- the semantic PersistentVolume's ONNX export -> the local cache (a PV after its first start).

Then: every process reports SERVING, a tenant's Generate is answered by replica `kvpool-0` (the
pod name from the downward API), the replica registered with the index under its advertised
address, asking again is a semantic hit, the internal credential, tenant and admin tokens are
enforced, every metrics port answers, each process stays under its pod's memory limit, and
SIGTERM drains every process to exit code 0 within the pod's termination grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.common.config import env_name
from services.launcher import service_exists, wait_healthy
from tests.deploy.k8s_view import (
    ROOT,
    Rendered,
    Workload,
    mem_bytes,
    resolve,
    tiercache_container,
)
from tests.e2e.conftest import LOG_DIR  # one folder per test run

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BOOT_ORDER = ("prefix", "semantic", "kvpool", "orchestrator")
BAKED_MODELS = "/opt/tiercache/models"


def distinct_free_ports(n: int) -> list[int]:
    """n different free loopback ports (held open together, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


class LocalCluster:
    """Maps what the rendered pods would see onto local processes, ports and directories."""

    def __init__(self, r: Rendered, tmp: Path) -> None:
        from services.common.model_store import cache_dir_default, resolve_model

        self.r = r
        self.tmp = tmp
        ports = distinct_free_ports(2 * len(r.workloads))
        self.grpc = {w.service: ports.pop() for w in r.workloads}
        self.metrics = {w.service: ports.pop() for w in r.workloads}
        self.model_dir = resolve_model("smollm2").path  # converts once if this machine has not
        self.onnx_cache = str(cache_dir_default())

    def local(self, svc: str) -> str:
        return f"127.0.0.1:{self.grpc[svc]}"

    def _paths(self, w: Workload) -> list[tuple[str, str]]:
        """(path in the pod, path here), longest first."""
        c = tiercache_container(w)
        vols = {v["name"]: v for v in w.pod_spec.get("volumes", [])}
        out = [(BAKED_MODELS + "/" + Path(self.model_dir).name, self.model_dir)]
        for m in c.get("volumeMounts", []):
            here = self.tmp / w.service / m["name"]
            here.mkdir(parents=True, exist_ok=True)
            secret = vols.get(m["name"], {}).get("secret")
            if secret:
                data = self.r.secret_data(secret["secretName"])
                for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
                    (here / item["path"]).write_text(data[item["key"]])
            out.append((m["mountPath"], str(here)))
        if w.service == "semantic":
            out.append(("/var/lib/tiercache/cache", self.onnx_cache))
        return sorted(out, key=lambda p: -len(p[0]))

    def env(self, w: Workload) -> dict[str, str]:
        svc = w.service
        rendered = {k: v.value for k, v in self.r.env(w, tiercache_container(w)).items()}
        paths = self._paths(w)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
        for k, v in rendered.items():
            for pod_path, here in paths:
                if v == pod_path or v.startswith(pod_path + "/"):
                    v = here + v[len(pod_path):]
                    break
            env[k] = v
        env[env_name(svc, "address")] = self.local(svc)
        env[env_name(svc, "metrics_port")] = str(self.metrics[svc])
        if env_name(svc, "advertise_address") in rendered:
            env[env_name(svc, "advertise_address")] = self.local(svc)
        own = (env_name(svc, "address"), env_name(svc, "advertise_address"))
        for k, v in rendered.items():
            if k.startswith(f"TIERCACHE_{svc.upper()}_") and k not in own \
                    and k.endswith(("_ADDRESS", "_ADDRESSES")):
                env[k] = ",".join(self.local(resolve(self.r, a.strip())[0].service)
                                  for a in v.split(",") if a.strip())
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "gen")])
        env["PYTHONUNBUFFERED"] = "1"
        return env


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM) so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _start(svc: str, env: dict[str, str]) -> subprocess.Popen:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = open(LOG_DIR / f"deploy-{svc}.log", "wb")  # noqa: SIM115 - owned by the child
    return subprocess.Popen([sys.executable, "-m", f"services.{svc}"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_dev_overlay_settings_boot_the_stack_and_serve_a_tenant(
        dev: Rendered, tmp_path: Path) -> None:
    assert all(service_exists(s) for s in BOOT_ORDER)
    from tiercache.v1 import (
        common_pb2,
        kvpool_pb2,
        kvpool_pb2_grpc,
        orchestrator_pb2,
        orchestrator_pb2_grpc,
        prefix_pb2,
        prefix_pb2_grpc,
    )

    cluster = LocalCluster(dev, tmp_path)
    secrets = dev.secret_data("tiercache-secrets")
    tokens = json.loads(secrets["tenant-tokens.json"])
    tenant_token = next(t for t, spec in tokens.items() if not spec.get("admin"))
    admin_token = next(t for t, spec in tokens.items() if spec.get("admin"))
    internal = [("authorization", f"Bearer {secrets['internal-token']}")]
    procs: dict[str, subprocess.Popen] = {}
    try:
        for svc in BOOT_ORDER:
            procs[svc] = _start(svc, cluster.env(dev.workload_for(svc)))
        for svc in BOOT_ORDER:
            wait_healthy(cluster.local(svc), 240, procs[svc])

        with grpc.insecure_channel(cluster.local("orchestrator")) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            req = orchestrator_pb2.GenerateRequest(
                messages=[orchestrator_pb2.ChatMessage(role="user", content="Name one colour.")],
                sampling=common_pb2.SamplingParams(max_tokens=8))
            # SERVING says the orchestrator is up; it learns that the replica is healthy from
            # its own poll, so the first request may still meet UNAVAILABLE (retryable).
            deadline = time.monotonic() + 30
            while True:
                try:
                    replies = list(stub.Generate(req, timeout=180, metadata=[
                        ("authorization", f"Bearer {tenant_token}")]))
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            final = replies[-1].final
            assert "".join(r.text for r in replies).strip()
            assert final.usage.completion_tokens > 0
            # The replica id is the pod name the downward API gave TIERCACHE_KVPOOL_REPLICA_ID.
            assert final.cache_report.replica_id == dev.workload_for("kvpool").pod_names()[0]
            # The answer was stored in the semantic tier (orchestrator -> semantic, with the
            # internal credential): asking again is a semantic hit.
            deadline = time.monotonic() + 20
            while True:
                again = list(stub.Generate(
                    req, timeout=60, metadata=[("authorization", f"Bearer {tenant_token}")]))
                if again[-1].final.cache_report.semantic_hit or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert again[-1].final.cache_report.semantic_hit
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Cluster-wide Stats: the operator's token only.
            with pytest.raises(grpc.RpcError) as err:
                stub.Stats(orchestrator_pb2.StatsRequest(), timeout=30,
                           metadata=[("authorization", f"Bearer {tenant_token}")])
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            stub.Stats(orchestrator_pb2.StatsRequest(), timeout=30,
                       metadata=[("authorization", f"Bearer {admin_token}")])

        with grpc.insecure_channel(cluster.local("kvpool")) as ch:
            stub = kvpool_pb2_grpc.KvPoolStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=10,
                              metadata=internal).replica_id == "kvpool-0"

        # kvpool registered with the index under its pod name and advertised (pod IP) address.
        with grpc.insecure_channel(cluster.local("prefix")) as ch:
            stub = prefix_pb2_grpc.PrefixIndexStub(ch)
            deadline = time.monotonic() + 20
            while True:
                stats = stub.Stats(prefix_pb2.PrefixStatsRequest(), timeout=10, metadata=internal)
                held = {r.replica_id: (r.address, r.held_blocks) for r in stats.replicas}
                if held.get("kvpool-0", ("", 0))[1] > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert held.get("kvpool-0", ("", 0))[0] == cluster.local("kvpool"), held
            assert held["kvpool-0"][1] > 0, "the replica published no stored blocks"

        for svc, port in cluster.metrics.items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                assert resp.status == 200 and b"# TYPE" in resp.read(), svc

        # Each process, having loaded and served, fits the memory limit its pod gets.
        for svc, p in procs.items():
            limit = mem_bytes(tiercache_container(dev.workload_for(svc))["resources"]["limits"][
                "memory"])
            peak = peak_rss_bytes(p.pid)
            assert peak < limit, f"{svc}: peak RSS {peak / 2**20:.0f} MiB over its limit"
    finally:
        codes = {}
        stop_at = time.monotonic()
        for p in procs.values():  # as when the whole release is deleted: all pods at once
            p.send_signal(signal.SIGTERM)
        for svc, p in procs.items():
            grace = dev.workload_for(svc).pod_spec["terminationGracePeriodSeconds"]
            try:
                codes[svc] = p.wait(max(0.0, stop_at + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[svc] = f"still running after {grace}s (kubelet would SIGKILL)"
                p.wait()
    assert codes == {svc: 0 for svc in BOOT_ORDER}, codes
