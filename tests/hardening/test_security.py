"""Security: TLS and mutual TLS by config, tenant isolation end to end, keyed block hashes,
limits (message size, concurrent streams, request rate) and secrets kept out of the logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    prefix_pb2,
    prefix_pb2_grpc,
)

from clients.python.client import TierCacheClient
from services import launcher
from services.common.hashing import DEFAULT_KEY, BlockHasher
from services.launcher import ServiceProcess, free_port, wait_healthy
from tests.certs import set_tls_env, tls_env
from tests.e2e.conftest import LOG_DIR, grpcurl_path
from tests.e2e.stack import wait_index_caught_up
from tests.hardening.conftest import (
    ADMIN,
    INTERNAL,
    INTERNAL_MD,
    SECRETS,
    TOK_A,
    TOK_B,
    TOK_ONE,
    TOK_RATE,
    md,
)

ROOT = Path(__file__).resolve().parents[2]
NO_SEMANTIC = common_pb2.CachePolicy(skip_semantic_lookup=True, skip_semantic_store=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run([str(ROOT / "scripts" / "gen-certs.sh"), str(out)], check=True,
                   capture_output=True, timeout=60)
    return out


def creds(certs: Path, client_cert: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(certs / "client.pem").read_bytes() if client_cert else None)


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    """The status a Health check gets on `channel` (OK if it got through)."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


# ---- TLS and mutual TLS ------------------------------------------------------------------------

@pytest.mark.e2e
def test_mutual_tls_process_refuses_clients_without_a_certificate(certs, monkeypatch):
    """A real prefix process configured only by environment: mTLS in, cert-less clients out."""
    port = free_port()
    p = ServiceProcess("prefix", port, {**tls_env(certs), "TIERCACHE_PREFIX_METRICS_PORT": "-1",
                                        "TIERCACHE_PREFIX_INTERNAL_TOKEN": INTERNAL},
                       log_path=LOG_DIR / "hard-tls-prefix.log").start()
    try:
        # What `make run` does: the launcher's health wait speaks mTLS from the same variables.
        p.wait(120)
        with pytest.raises(TimeoutError):
            wait_healthy(p.address, 1.5, env={})  # a plaintext health check never gets through
        # The grpcurl line `make run` prints for a TLS stack works as printed.
        set_tls_env(monkeypatch, certs)
        flags = launcher.grpcurl_transport()
        assert "-plaintext" not in flags and "-cert" in flags
        r = subprocess.run([grpcurl_path(), *flags.split(), p.address,
                            "grpc.health.v1.Health/Check"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stderr
        with grpc.secure_channel(p.address, creds(certs)) as ch:
            st = prefix_pb2_grpc.PrefixIndexStub(ch).Stats(prefix_pb2.PrefixStatsRequest(),
                                                           timeout=10, metadata=INTERNAL_MD)
            assert st.block_size == 16
        with grpc.secure_channel(p.address, creds(certs, client_cert=False)) as ch:
            assert refused(ch) == grpc.StatusCode.UNAVAILABLE  # handshake fails: no client cert
        with grpc.insecure_channel(p.address) as ch:
            assert refused(ch) == grpc.StatusCode.UNAVAILABLE  # plaintext is not spoken
        other = grpc.ssl_channel_credentials(root_certificates=(certs / "server.pem").read_bytes())
        with grpc.secure_channel(p.address, other) as ch:
            assert refused(ch) == grpc.StatusCode.UNAVAILABLE  # does not trust our CA
    finally:
        p.stop()


@pytest.mark.e2e
def test_tls_without_client_certificates_is_spoken_by_the_internal_clients(certs):
    """Servers with only TIERCACHE_TLS_CERT/_KEY (TLS, no mutual TLS): internal clients and the
    launcher's health wait must speak TLS too (verifying against the system's roots, here
    pointed at our CA), not plaintext, or `make run` waits out its timeout."""
    port = free_port()
    server_only = {"TIERCACHE_TLS_CERT": str(certs / "server.pem"),
                   "TIERCACHE_TLS_KEY": str(certs / "server.key")}
    p = ServiceProcess("prefix", port, {**server_only, "TIERCACHE_PREFIX_METRICS_PORT": "-1"},
                       log_path=LOG_DIR / "hard-tls-server-only-prefix.log").start()
    try:
        with grpc.secure_channel(p.address, creds(certs, client_cert=False)) as ch:
            end = time.monotonic() + 120
            while refused(ch) != grpc.StatusCode.OK:  # up, and TLS without a client cert
                assert time.monotonic() < end and p.proc.poll() is None
                time.sleep(0.5)
        # A fresh process: gRPC reads its default roots once per process.
        env = {**os.environ, **server_only, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH":
               str(certs / "ca.pem"), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'gen'}"}
        env.pop("TIERCACHE_TLS_CA", None)
        code = ("import sys; from services.launcher import wait_healthy; "
                f"wait_healthy({p.address!r}, 20); "
                "from services.common.grpc_client import make_channel; "
                "from grpc_health.v1 import health_pb2, health_pb2_grpc; "
                f"ch = make_channel({p.address!r}); "
                "print(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), "
                "timeout=10).status)")
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "1"  # SERVING
    finally:
        p.stop()


def big_vocab_tiny_model(vocab: int):
    """A random Llama the size of a unit test, with SmolLM2's vocabulary size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=1024, eos_token_id=2, bos_token_id=1,
                      pad_token_id=2, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = 2
    return m


@pytest.mark.model  # the orchestrator loads the real SmolLM2 tokenizer
def test_mutual_tls_between_all_four_services_by_config(certs, monkeypatch, tmp_path, capsys):
    """All four services in-process, TLS for every listener and every internal client from the
    same environment variables the processes read. A Generate crosses orchestrator -> semantic,
    prefix and kvpool, and kvpool publishes to the index: every hop is mutual TLS."""
    from services.common.bootstrap import create_server
    from services.common.model_store import load_tokenizer, resolve_model
    from services.kvpool.app import build_replica
    from services.kvpool.config import KvPoolConfig
    from services.kvpool.publisher import Publisher
    from services.kvpool.server import KvPoolServicer
    from services.orchestrator.app import build
    from services.orchestrator.config import OrchestratorConfig
    from services.orchestrator.server import OrchestratorServicer
    from services.prefix.config import PrefixConfig
    from services.prefix.server import serve as serve_prefix
    from services.semantic.config import SemanticConfig
    from services.semantic.server import serve as serve_semantic

    set_tls_env(monkeypatch, certs)
    stops = []
    try:
        prefix = serve_prefix(PrefixConfig(address="127.0.0.1:0", internal_token=INTERNAL))
        stops.append(prefix.stop)
        sem = serve_semantic(SemanticConfig(address="127.0.0.1:0", metrics_port=-1,
                                            db_path=str(tmp_path / "s.db"),
                                            internal_token=INTERNAL))
        stops.append(lambda: sem.stop(0))
        vocab = len(load_tokenizer(resolve_model("smollm2").path))
        kcfg = KvPoolConfig(address="127.0.0.1:0", metrics_port=-1, num_blocks=64,
                            replica_id="kv-tls", internal_token=INTERNAL,
                            prefix_address=prefix.address, heartbeat_seconds=0.3,
                            max_new_tokens_limit=16)
        kserv = KvPoolServicer(kcfg)
        khandle = create_server(service="kvpool", address=kcfg.address, internal_token=INTERNAL,
                                services=[(kvpool_pb2_grpc.add_KvPoolServicer_to_server, kserv,
                                           "tiercache.v1.KvPool")])
        stops.append(lambda: khandle.stop(0))
        replica = build_replica(kcfg, model=big_vocab_tiny_model(vocab), model_id="tiny-tls",
                                metrics=False)
        stops.append(replica.engine.stop)
        pub = Publisher(replica.engine, address=prefix.address, replica_id="kv-tls",
                        incarnation=kserv.incarnation, public_address=khandle.address,
                        model_id="tiny-tls", heartbeat_seconds=0.3,
                        publish_interval_seconds=0.05, internal_token=INTERNAL).start()
        stops.append(pub.stop)
        kserv.attach(replica.engine, replica.info, pub)
        khandle.set_serving()

        ocfg = OrchestratorConfig(
            address="127.0.0.1:0", metrics_port=-1, internal_token=INTERNAL,
            kvpool_addresses=(khandle.address,), semantic_address=sem.handle.address,
            prefix_addresses=(prefix.address,), model_id="tiny-tls", tokens="tok-t=t",
            warm_interval_s=0, replica_poll_s=0.2, max_tokens_limit=16, default_max_tokens=4)
        oserv = OrchestratorServicer(ocfg)
        ohandle = create_server(service="orchestrator", address=ocfg.address,
                                services=[(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server,
                                           oserv, "tiercache.v1.Orchestrator")])
        stops.append(lambda: ohandle.stop(0))
        app = build(ocfg)
        stops.append(app.close)
        oserv.attach(app.orch, app.tenants, app.warmer)
        ohandle.set_serving()

        q = "Is every hop of this request encrypted?"
        with TierCacheClient(ohandle.address, token="tok-t", timeout=60,
                             credentials=creds(certs)) as c:
            end = time.monotonic() + 30
            while True:  # the replica poll marks kv-tls healthy within a few polls
                try:
                    first = c.generate(q, max_tokens=4, ignore_eos=True)
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < end
                    time.sleep(0.3)
            assert first.report.replica_id == "kv-tls" and first.completion_tokens == 4
            again = c.generate(q, max_tokens=4, ignore_eos=True)
            assert again.report.semantic_hit  # stored in, and found by, semantic over mTLS
        # The CLI takes its TLS files from the same variables (or --ca/--cert/--key).
        from clients.python.cli import main as cli

        capsys.readouterr()
        assert cli(["--address", ohandle.address, "--token", "tok-t", "chat", q,
                    "--max-tokens", "4"]) == 0
        out = capsys.readouterr()
        assert out.out.strip() == again.text.strip() and "semantic hit" in out.err
        assert cli(["--address", ohandle.address, "--token", "tok-t", "--ca", "", "--cert", "",
                    "--key", "", "--timeout", "5", "chat", q]) == 75  # plaintext: refused
        # gRPC says only "Socket closed" (as of a server going away): retry later, EX_TEMPFAIL.
        assert "UNAVAILABLE (retry later)" in capsys.readouterr().err
        with grpc.secure_channel(prefix.address, creds(certs)) as ch:
            st = prefix_pb2_grpc.PrefixIndexStub(ch).Stats(prefix_pb2.PrefixStatsRequest(),
                                                           timeout=10, metadata=INTERNAL_MD)
        assert [r.replica_id for r in st.replicas] == ["kv-tls"]  # registered over mTLS
        for addr in (ohandle.address, sem.handle.address, khandle.address, prefix.address):
            with grpc.secure_channel(addr, creds(certs, client_cert=False)) as ch:
                assert refused(ch) == grpc.StatusCode.UNAVAILABLE, addr
            with grpc.insecure_channel(addr) as ch:
                assert refused(ch) == grpc.StatusCode.UNAVAILABLE, addr
    finally:
        for stop in reversed(stops):
            stop()


# ---- keyed block hashes -----------------------------------------------------------------------

def test_block_hashes_are_keyed_and_cannot_be_reproduced_without_the_key():
    toks = list(range(64))
    prod = BlockHasher("m", 16, b"cluster-secret-key").hashes(toks, "salt")
    # Same construction, another key (or the dev default): no hash in common.
    for key in (b"cluster-secret-kez", DEFAULT_KEY, b""):
        other = BlockHasher("m", 16, key).hashes(toks, "salt")
        assert not set(other) & set(prod)
    # Deterministic with the key (pool and index agree), and the chain depends on the salt.
    assert prod == BlockHasher("m", 16, b"cluster-secret-key").hashes(toks, "salt")
    assert not set(BlockHasher("m", 16, b"cluster-secret-key").hashes(toks, "tenant-b")) & set(
        prod)
    # The index refuses a replica hashing with another key (see test_bad_input: Register
    # "wrong hash key" -> FAILED_PRECONDITION hash_probe) and, with verify_hashes, any block
    # whose hash does not match its tokens ("forged hashes" -> INVALID_ARGUMENT).


# ---- tenant isolation, limits, secrets (shared process stack) --------------------------------

SYSTEM = ("You are the archive assistant of the Lindqvist family. " + " ".join(
    f"Record {i}: box {i} holds letters from {1900 + i} and photographs of the harbour."
    for i in range(8)))


def gen(client: TierCacheClient, text, **kw):
    kw.setdefault("max_tokens", 4)
    return client.generate(text, **kw)


@pytest.mark.e2e
@pytest.mark.model
def test_tenant_isolation_end_to_end(stack):
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which box holds the letters from 1903?"}]
    with TierCacheClient(stack.orch.address, token=TOK_A, timeout=120) as a, \
            TierCacheClient(stack.orch.address, token=TOK_B, timeout=120) as b:
        first = gen(a, msgs)
        assert not first.report.semantic_hit
        # a2's Match must find a's blocks in the index (published a moment after `first`) to
        # count as a hit on a's prefix, which makes it one of a's hot prefixes for the top-k
        # warm-up below. Without this wait a2 could match nothing there yet still reuse the
        # blocks on the replica the ring chose, and the warm-up found nothing of a's to warm.
        wait_index_caught_up(stack, metadata=INTERNAL_MD)
        assert gen(a, msgs).report.semantic_hit  # a's own answer is cached for a
        a2 = gen(a, msgs, cache_policy=NO_SEMANTIC)
        assert a2.report.cached_tokens > 0  # and so is a's prefix

        # b sends the very same conversation: no semantic hit on a's answer, no cached prefix.
        rb = gen(b, msgs)
        assert not rb.report.semantic_hit and rb.report.cached_tokens == 0
        assert rb.report.semantic_entry_id != first.report.semantic_entry_id
        # b now has its own copy, a's was never shared. The routing's recent-share rule may
        # send a repeated new conversation to the replica that served it less (a's three went
        # to one): a CI run saw b's second request land there by the ring, with nothing cached.
        # After two, both replicas hold b's copy, so the third reuses it wherever it goes.
        for _ in range(3):
            rb2 = gen(b, msgs, cache_policy=NO_SEMANTIC)
            if rb2.report.cached_tokens > 0:
                break
        assert rb2.report.cached_tokens > 0, rb2.report

        # b cannot rate or invalidate a's answer, even holding a's entry reference.
        ref = first.report.semantic_entry_id
        assert ref
        for stolen in (ref, ref.split(".")[0]):
            with pytest.raises(grpc.RpcError) as e:
                b.feedback(stolen, good=False)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert gen(a, msgs).report.semantic_hit  # still there for a
        assert a.feedback(ref, good=True).verified  # and a's own reference works

        # Warm with top_k never hands a another tenant's hot prefixes: b makes a longer
        # conversation of its own hot; a's top-k warm-up may prefill only prefixes of at most
        # a's own prompt length (and does prefill some: the replica a did not use lacks them).
        msgs_b = [{"role": "system", "content": SYSTEM + " " + SYSTEM.replace("Record", "Entry")},
                  {"role": "user", "content": "Which box holds the photographs?"}]
        longer = gen(b, msgs_b, cache_policy=NO_SEMANTIC)
        gen(b, msgs_b, cache_policy=NO_SEMANTIC)
        assert longer.prompt_tokens > first.prompt_tokens + 64
        w = a.warm(top_k=50)
        assert w.results and all(not r.error for r in w.results), w
        assert all(r.prompt_index == -1 and 0 < r.prompt_tokens <= first.prompt_tokens
                   for r in w.results), w
        # Cluster-wide Stats (every tenant's traffic) are for operators only.
        for c in (a, b):
            with pytest.raises(grpc.RpcError) as e:
                c.stats()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stack.admin_stats().requests_total >= 5


@pytest.mark.e2e
@pytest.mark.model
def test_per_tenant_rate_limit(stack):
    """tok-rate: 0.5 requests/s, burst 3. A burst of 6 Feedback calls: 3 pass the limiter (and
    fail validation), the rest are RESOURCE_EXHAUSTED; other tenants are unaffected; two
    seconds later one more request is allowed."""
    ch = grpc.insecure_channel(stack.orch.address)
    stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
    req = orchestrator_pb2.FeedbackRequest()  # invalid: cheap, never touches a dependency
    codes = []
    for _ in range(6):
        try:
            stub.Feedback(req, timeout=10, metadata=md(TOK_RATE))
        except grpc.RpcError as e:
            codes.append((e.code(), e.details()))
    assert [c for c, _ in codes[:3]] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert {c for c, _ in codes[3:]} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "rate limit" in codes[3][1]
    for _ in range(6):  # tenant a has no rate limit
        with pytest.raises(grpc.RpcError) as e:
            stub.Feedback(req, timeout=10, metadata=md(TOK_A))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    time.sleep(2.2)
    with pytest.raises(grpc.RpcError) as e:
        stub.Feedback(req, timeout=10, metadata=md(TOK_RATE))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ch.close()


@pytest.mark.e2e
@pytest.mark.model
def test_concurrent_stream_limit_per_tenant(stack):
    """tok-one may hold one stream: a second concurrent one is RESOURCE_EXHAUSTED, and once the
    first ends the tenant can stream again (the slot is released, not leaked)."""
    with TierCacheClient(stack.orch.address, token=TOK_ONE, timeout=120) as c:
        started = threading.Event()
        result = {}
        kv_pids = [k.proc.pid for k in stack.kv]

        def long_stream():
            for ch in c.stream("Tell me a long story about ships.", max_tokens=16,
                               ignore_eos=True, cache_policy=NO_SEMANTIC):
                if not started.is_set():
                    # The replicas stop mid-answer: the stream (and its tenant slot) stays
                    # open however fast the machine would have finished its 16 tokens.
                    for pid in kv_pids:
                        os.kill(pid, signal.SIGSTOP)
                    started.set()
                if ch.final is not None:
                    result["final"] = ch.final

        t = threading.Thread(target=long_stream)
        t.start()
        try:
            assert started.wait(60)
            with pytest.raises(grpc.RpcError) as e:
                gen(c, "And a short one?", cache_policy=NO_SEMANTIC)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "concurrent" in e.value.details()
        finally:
            for pid in kv_pids:
                os.kill(pid, signal.SIGCONT)
        t.join(120)
        assert "final" in result
        assert gen(c, "And now a short one?", cache_policy=NO_SEMANTIC).completion_tokens > 0


@pytest.mark.e2e
@pytest.mark.model
def test_secrets_never_reach_the_logs(stack):
    """Run authenticated traffic (good and bad tokens), then grep every service's log."""
    with TierCacheClient(stack.orch.address, token=TOK_A, timeout=120) as a:
        gen(a, "Say hello.", cache_policy=NO_SEMANTIC)
    with TierCacheClient(stack.orch.address, token="tok-wrong-leak-canary", timeout=30) as bad:
        with pytest.raises(grpc.RpcError):
            gen(bad, "hi")
    stack.admin_stats()
    logs = stack.logs()
    assert len(logs) > 1000  # the services did write logs
    for secret in (*SECRETS, "tok-wrong-leak-canary", ADMIN):
        assert secret not in logs, f"{secret[:6]}... found in service logs"
