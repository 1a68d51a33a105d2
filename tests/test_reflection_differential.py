"""A differential review of `services.common.reflection` against a model of its docstrings and
docs/deploy.md ("Debug with grpcurl"), through a real reflection client: grpc_reflection's
ProtoReflectionDescriptorDatabase (what a Python tool uses; grpcurl speaks the same protocol)
over a real loopback server.

Model. `source_info_pool(path)`: None when `path` does not exist (a server then serves the
compiled, comment-less descriptors, method names resolving all the same); otherwise a pool that
serves every file the process compiled in, the set's own bytes for each file the set at `path`
holds (with its comments) and the compiled descriptor for the others. `descriptor_set_path()`:
gen/'s set when it exists, else the first `tiercache_descriptors.pb` that exists in the
`tiercache` package's folders, else gen/'s path. Through the client: `get_services` is the
sorted names the server registered; `FindFileContainingSymbol(s)` is the file that declares `s`
(a message, a nested one, a field, a oneof, an enum, its values, a service, a method), as the
model says it is served, with every file it imports, transitively, arriving in the same answer;
`FindFileByName` the same by name; a name nothing declares a KeyError (the server's NOT_FOUND;
any other status fails the client's own assertion); `FindAllExtensionNumbers` of a message []
(the protos declare none), of an unknown type a KeyError; and a DescriptorPool built on the
client resolves each registered service's methods, and decodes a message the compiled classes
wrote, field for field.

Each seed's set, by turns: gen/tiercache_descriptors.pb itself; all or a random part of its
files, each with a marker appended to one of its comments (so a served file is known to come
from that set and not from gen/); or none (a path that does not exist). The server is
`bootstrap.create_server` (the seed's set put where `descriptor_set_path` looks first) or a
plain `grpc.server` given `source_info_pool(path)`. Symbols are asked in random order from
fresh clients and from one client that caches what it got, with unknown names mixed in ("",
".", unicode, a method of a message, a trailing dot, a known symbol with a suffix).

Run offline: 300 seeds twice (REFLECTION_DIFFERENTIAL_SEEDS=300: some 20,000 client look-ups
over 300 servers, 9,000 `descriptor_set_path` layouts); 6 by default (~1.5 s).
Found and fixed (services/common/bootstrap.py, guarded in tests/test_reflection_rules.py):
without the descriptor set (`source_info_pool()` None: not generated) the server handed the
stock pool to the reflection servicer, and every method's name was NOT_FOUND again (the fix for
methods lived only in SourceInfoPool); it now serves the compiled descriptors through
`SourceInfoPool({})`. Left as is: a set older than the compiled protos is served as it is
(`make protos` writes both); the client's own cache answers a made-up field of a message it
already holds with that message's file (protobuf's DescriptorDatabase does so; made-up names
go to fresh clients). Also found: bootstrap's per-client stream cap refused, now and then, the
stock client's next one-request stream when the server had not yet cleaned up the last (4 of
300 seeds); a stream over the cap now waits OPEN_SLOT_GRACE_S for a slot (test_bootstrap.py),
and this test uses the stock client as it is.
Injected bugs caught: 13 of 13 (the set's bytes ignored, only its first file kept,
dependencies not wrapped (imports without comments), no dependencies, the method fallback
dropped, any method name of a known service accepted, the symbol split at its first dot,
source_info_pool without its existence check, gen/'s set not preferred, the package's set
ignored, the package's folders in reverse, bootstrap's stock pool back, FindFileByName
unwrapped).
`REFLECTION_DIFFERENTIAL_SEEDS=N` runs more.
"""

from __future__ import annotations

import importlib.util
import os
import random
import types
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor_database import DescriptorDatabase
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as stock_reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2,
    kvpool_pb2_grpc,
    orchestrator_pb2_grpc,
    prefix_pb2,
    prefix_pb2_grpc,
    semantic_pb2_grpc,
)

from services.common import reflection
from services.common.bootstrap import create_server
from tests import descriptors

SEEDS = int(os.environ.get("REFLECTION_DIFFERENTIAL_SEEDS", "6"))
TLS_VARS = ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY")
SERVICES = [
    (kvpool_pb2_grpc.add_KvPoolServicer_to_server, kvpool_pb2_grpc.KvPoolServicer,
     "tiercache.v1.KvPool"),
    (orchestrator_pb2_grpc.add_OrchestratorServicer_to_server,
     orchestrator_pb2_grpc.OrchestratorServicer, "tiercache.v1.Orchestrator"),
    (prefix_pb2_grpc.add_PrefixIndexServicer_to_server, prefix_pb2_grpc.PrefixIndexServicer,
     "tiercache.v1.PrefixIndex"),
    (semantic_pb2_grpc.add_SemanticCacheServicer_to_server,
     semantic_pb2_grpc.SemanticCacheServicer, "tiercache.v1.SemanticCache"),
]
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
# Files outside the set the model also resolves: compiled in, served without comments.
OTHER_FILES = ["grpc_health/v1/health.proto", "grpc_reflection/v1alpha/reflection.proto"]


def _client(ch: grpc.Channel) -> ProtoReflectionDescriptorDatabase:
    """The stock client: a one-request stream a question, the next opened as soon as the last
    answered (bootstrap's per-client cap waits a moment for the last one's slot)."""
    return ProtoReflectionDescriptorDatabase(ch)


@pytest.fixture()
def plaintext(monkeypatch):
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)


def _gen_set() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    return {f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(
        reflection.DESCRIPTOR_SET.read_bytes()).file}


def _marked(f: descriptor_pb2.FileDescriptorProto, mark: str) -> descriptor_pb2.FileDescriptorProto:
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(f)
    locs = [loc for loc in out.source_code_info.location if loc.leading_comments]
    assert locs, f.name
    locs[0].leading_comments += f" {mark}"
    return out


class Server:
    """A loopback server with some of TierCache's services, health and reflection:
    `bootstrap.create_server`'s, or a plain one over `source_info_pool(pool_path)`."""

    def __init__(self, chosen, pool_path: Path | None, bootstrap: bool) -> None:
        names = [n for *_, n in chosen]
        if bootstrap:
            self.h = create_server(service="refl-diff", address="127.0.0.1:0",
                                   services=[(add, cls(), n) for add, cls, n in chosen])
            self.port = self.h.port
            self.stop = lambda: self.h.stop(0)
        else:
            self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            for add, cls, _ in chosen:
                add(cls(), self.server)
            health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
            stock_reflection.enable_server_reflection(
                [*names, HEALTH, stock_reflection.SERVICE_NAME], self.server,
                pool=reflection.source_info_pool(pool_path))
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            self.server.start()
            self.stop = lambda: self.server.stop(0)
        self.names = sorted([*names, HEALTH, REFLECTION])


def _world(seed: int, tmp_path: Path, monkeypatch):
    """(the set the model says is served: {file: proto}, its path or None for the default
    lookup, whether the server is bootstrap's). Bootstrap's server finds the set the module's
    way, so a set of the seed's own is put where that lookup looks first."""
    rng = random.Random(seed ^ 0x5EED)
    gen = _gen_set()
    kind = ["default", "part", "missing", "all", "part"][seed % 5]
    bootstrap = kind in ("default", "missing") or rng.random() < 0.5
    if kind == "default":
        return gen, None, True
    path = tmp_path / f"set-{seed}.pb"
    if kind == "missing":
        assert reflection.source_info_pool(path) is None
        served = {}
    else:
        names = sorted(gen)
        keep = names if kind == "all" else rng.sample(names, rng.randint(0, len(names)))
        served = {n: _marked(gen[n], f"[seed {seed} {n}]") for n in keep}
        path.write_bytes(descriptor_pb2.FileDescriptorSet(file=list(served.values()))
                         .SerializeToString())
    if bootstrap:
        monkeypatch.setattr(reflection, "DESCRIPTOR_SET", path)
        monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
        return served, None, True
    return served, path, False


@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_reflection_client_sees_what_the_model_serves(seed, tmp_path, plaintext, monkeypatch):
    rng = random.Random(seed)
    gen = _gen_set()
    served, path, bootstrap = _world(seed, tmp_path, monkeypatch)

    def want(name: str) -> descriptor_pb2.FileDescriptorProto:
        return served[name] if name in served else descriptors.compiled(name)

    declared = {s: n for n, f in gen.items() for s in descriptors.symbols(f)}
    declared.update({s: n for n in OTHER_FILES
                     for s in descriptors.symbols(descriptors.compiled(n))})
    files = sorted(set(gen) | set(OTHER_FILES))
    some = rng.choice(sorted(declared))
    unknown = ["", ".", "tiercache", "tiercache.v1", "tiercache.v1.Nope", "\u00fc.\u6f22",
               "tiercache.v1.KvPool.Nope", "tiercache.v1.KvPool.",
               "tiercache.v1.MatchRequest.Match",
               "grpc.health.v1.Health.Nope", "tiercache.v1.KvPool.Generate.x", some + "x",
               "Generate", ".tiercache.v1..KvPool"]
    unknown = [u for u in unknown if u not in declared]
    chosen = rng.sample(SERVICES, rng.randint(1, len(SERVICES)))
    srv = Server(chosen, path, bootstrap)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    cached = _client(ch)
    try:
        assert cached.get_services() == srv.names
        ops = ([("symbol", s) for s in rng.sample(sorted(declared), 40)]
               + [("method", f"{n}.{m.name}") for *_, n in chosen
                  for m in descriptor_pool.Default().FindServiceByName(n).methods]
               + [("file", n) for n in files] + [("unknown", u) for u in unknown]
               + [("nofile", n) for n in ["nope.proto", "", "tiercache/v1/nope.proto"]]
               + [("ext", "tiercache.v1.MatchRequest"), ("noext", "nope.Nope")])
        rng.shuffle(ops)
        for op, arg in ops:
            fresh = op in ("unknown", "nofile", "noext") or rng.random() < 0.5
            db = _client(ch) if fresh else cached
            if op in ("symbol", "method", "file"):
                name = arg if op == "file" else declared[arg]
                got = (db.FindFileByName(arg) if op == "file"
                       else db.FindFileContainingSymbol(arg))
                assert got == want(name), (op, arg, name)
                if fresh:  # its imports came in the same answer: the client holds them all
                    for dep in descriptors.closure(name):
                        assert DescriptorDatabase.FindFileByName(db, dep) == want(dep), dep
            elif op == "ext":
                assert list(db.FindAllExtensionNumbers(arg)) == []
            else:
                with pytest.raises(KeyError):
                    {"unknown": db.FindFileContainingSymbol, "nofile": db.FindFileByName,
                     "noext": db.FindAllExtensionNumbers}[op](arg)
        # A pool on the client: the services' methods, and a message the compiled code wrote.
        pool = descriptor_pool.DescriptorPool(_client(ch))
        for *_, n in chosen:
            compiled = descriptor_pool.Default().FindServiceByName(n)
            got = pool.FindServiceByName(n)
            assert [(m.name, m.input_type.full_name, m.output_type.full_name)
                    for m in got.methods] == [(m.name, m.input_type.full_name,
                                               m.output_type.full_name)
                                              for m in compiled.methods]
        for msg in [kvpool_pb2.KvGenerateRequest(
                        request_id="r", token_ids=[1, 2, 3], model_id="m",
                        sampling=common_pb2.SamplingParams(max_tokens=4, stop_token_ids=[9])),
                    prefix_pb2.MatchRequest(), health_pb2.HealthCheckResponse(status=1)]:
            cls = message_factory.GetMessageClass(
                pool.FindMessageTypeByName(msg.DESCRIPTOR.full_name))
            back = cls.FromString(msg.SerializeToString())
            assert back.SerializeToString(deterministic=True) == msg.SerializeToString(
                deterministic=True)
            assert str(back) == str(msg)
    finally:
        ch.close()
        srv.stop()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_descriptor_set_path_matches_the_model(seed, tmp_path, monkeypatch):
    """gen/'s set when it exists, else the first of the `tiercache` package's folders that has
    one, else gen/'s path (for source_info_pool's 'not generated' None)."""
    rng = random.Random(seed)
    for case in range(30):
        base = tmp_path / str(case)
        gen = base / "gen" / reflection.DESCRIPTOR_SET_NAME
        gen.parent.mkdir(parents=True)
        folders = [base / f"pkg{i}" for i in range(rng.randint(0, 3))]
        for f in folders:
            f.mkdir()
            if rng.random() < 0.5:
                (f / reflection.DESCRIPTOR_SET_NAME).write_bytes(b"")
        if rng.random() < 0.4:
            gen.write_bytes(b"")
        spec = rng.choice(["package", "package", "module", "none"])
        if spec == "package":
            found = types.SimpleNamespace(submodule_search_locations=[str(f) for f in folders])
        elif spec == "module":
            found = types.SimpleNamespace(submodule_search_locations=None)
        else:
            found = None
        asked: list[str] = []
        monkeypatch.setattr(reflection, "DESCRIPTOR_SET", gen)
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, _asked=asked, _found=found: _asked.append(name)
                            or _found)
        candidates = [gen] + ([f / reflection.DESCRIPTOR_SET_NAME for f in folders]
                              if spec == "package" else [])
        want = next((c for c in candidates if c.exists()), gen)
        assert reflection.descriptor_set_path() == want, (case, candidates)
        assert asked in ([], ["tiercache"])
        pool = reflection.source_info_pool()
        assert (pool is None) == (not want.exists())
