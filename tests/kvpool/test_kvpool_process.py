"""`python -m services.kvpool` as a real process over a local model folder."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from tiercache.v1 import common_pb2, kvpool_pb2, kvpool_pb2_grpc

from services.common.bootstrap import HEALTH_PATH
from services.kvpool.linear import pack_linears
from services.launcher import free_port
from tests.kvpool.conftest import make_tiny_model, reference_greedy
from tests.procs import terminate, wait_serving

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_process_serves_a_local_model_folder_and_stops_on_sigterm(tmp_path: Path,
                                                                   dtype: str) -> None:
    model = make_tiny_model().to(getattr(torch, dtype))
    folder = tmp_path / "tiny-folder"
    model.save_pretrained(folder)
    port, metrics_port = free_port(), free_port()
    while metrics_port == port:
        metrics_port = free_port()
    env = dict(os.environ, TIERCACHE_KVPOOL_MODEL=str(folder),
               TIERCACHE_KVPOOL_ADDRESS=f"127.0.0.1:{port}",
               TIERCACHE_KVPOOL_METRICS_PORT=str(metrics_port),
               TIERCACHE_KVPOOL_NUM_BLOCKS="64", TIERCACHE_KVPOOL_REPLICA_ID="kv-proc",
               TIERCACHE_KVPOOL_DTYPE=dtype)
    proc = subprocess.Popen([sys.executable, "-m", "services.kvpool", "--block-size", "4"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        wait_serving(channel, "tiercache.v1.KvPool", proc, 60, proc.stderr.read)
        # The pod's readiness and liveness probes ask the metrics port (docs/deploy.md).
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{HEALTH_PATH}",
                                    timeout=5) as r:
            assert (r.status, r.read()) == (200, b"SERVING\n")
        stub = kvpool_pb2_grpc.KvPoolStub(channel)
        st = stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
        assert (st.model_id, st.block_size, st.blocks_total) == ("tiny-folder", 4, 64)
        assert st.dtype == dtype
        # A float32 CPU model runs on oneDNN with packed weights where this torch has it, a
        # bfloat16 one where this CPU also runs bfloat16 natively.
        packing = pack_linears(model)
        assert (st.linear_kernels, st.linear_kernels_why) == (packing.kernels, packing.why_not)
        prompt = [3, 14, 15, 92, 65, 35, 89, 79]
        toks = []
        for msg in stub.Generate(kvpool_pb2.KvGenerateRequest(
                token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=6)), timeout=30):
            toks.extend(msg.token_ids)
        if dtype == "float32":
            assert toks == reference_greedy(model, prompt, 6)  # on the replica's kernels
        else:
            # Logits from a float32 head over bfloat16 layers: near-ties may differ from a
            # plain bfloat16 forward, but not from the same replica built in this process.
            assert toks == _in_process(folder, dtype, prompt, 6) and len(toks) == 6
    finally:
        channel.close()
        rc = terminate(proc)
    assert rc == 0, proc.stderr.read()[-6000:]  # a crash at exit: faulthandler's stacks


def _in_process(folder: Path, dtype: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the replica the process builds (same config, same kernels), built
    here."""
    from services.kvpool.app import build_replica
    from services.kvpool.config import KvPoolConfig
    from tests.kvpool.conftest import collect, request

    cfg = KvPoolConfig(model=str(folder), dtype=dtype, num_blocks=64, block_size=4,
                       replica_id="kv-ref")
    cfg.validate()
    replica = build_replica(cfg, metrics=False)
    try:
        toks, _ = collect(replica.engine.submit(request(prompt, n))[1])
    finally:
        replica.engine.stop()
    return toks
