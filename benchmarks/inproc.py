"""A replica engine in this process, and requests run through it together (for the studies
that time the engine itself: `benchmarks.draft_batch`, `benchmarks.prompt_lookup`)."""

from __future__ import annotations

import dataclasses
import os
import platform
import threading
import time
from typing import Any, NamedTuple

import torch

from services.kvpool.engine import EngineRequest, Failed, Finished, TokenDelta


class Streamed(NamedTuple):
    """One request's answer: its tokens, when its first and last arrived (perf_counter
    seconds), and its Finished."""

    tokens: list[int]
    first: float
    end: float
    final: Finished


def load_replica(max_batch_size: int, num_blocks: int = 1024, device: str = "cpu") -> Any:
    """A replica built as `python -m services.kvpool` builds it (the model loaded on one
    thread, the engine on torch's threads, its draft ladder timed at start) on `device`."""
    from services.kvpool.app import build_replica
    from services.kvpool.config import KvPoolConfig

    cfg = KvPoolConfig(num_blocks=num_blocks, max_batch_size=max_batch_size, device=device)
    cfg = dataclasses.replace(cfg, torch_threads=cfg.torch_threads or torch.get_num_threads())
    torch.set_num_threads(1)
    print("loading the replica (its draft ladder is timed at start) ...", flush=True)
    replica = build_replica(cfg, metrics=False)
    ladder = replica.engine.draft_ladder
    print(f"draft ladder {ladder.ladder} ({ladder.source})", flush=True)
    return replica


def result_header(replica: Any, benchmark: str, command: str, max_tokens: int) -> dict:
    """The opening fields of a study's result: what ran, on what, with which draft ladder."""
    engine = replica.engine
    ladder = engine.draft_ladder
    return {
        "benchmark": benchmark,
        "command": command,
        "model": f"{replica.info.model_id} {str(engine.store.dtype).removeprefix('torch.')} "
                 f"{engine.device.type}, "
                 f"{engine.packing.kernels} kernels, greedy, up to {max_tokens} tokens",
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "cpus": os.cpu_count(), "torch_threads": engine.threads,
                 "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                 "load_avg_at_end": list(os.getloadavg())},
        "draft_ladder": list(ladder.ladder), "draft_ladder_source": ladder.source,
        "draft_forward_costs": list(ladder.costs),
        "draft_cheap_guesses": ladder.cheap_guesses,
    }


def run_together(engine: Any, requests: list[EngineRequest]) -> tuple[float, list[Streamed]]:
    """Submit every request while the engine thread is held, so all are admitted together;
    returns when they were let go (perf_counter seconds) and each one's `Streamed`, read by a
    thread of its own so that each is timed as it streams.

    Raises:
        RuntimeError: the engine thread never reached the hold, or a request failed.
    """
    gate, held = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), gate.wait(120)))
    if not held.wait(60):
        raise RuntimeError("the engine thread never reached the hold")
    outs = [engine.submit(r)[1] for r in requests]
    res: list[Streamed | Exception | None] = [None] * len(outs)

    def read(k: int) -> None:
        got: list[int] = []
        first = None
        while True:
            msg = outs[k].get(timeout=900)
            if isinstance(msg, TokenDelta):
                first = first or time.perf_counter()
                got += msg.token_ids
            elif isinstance(msg, Failed):
                res[k] = RuntimeError(f"request {requests[k].request_id} failed: {msg.error}")
                return
            elif isinstance(msg, Finished):
                now = time.perf_counter()
                res[k] = Streamed(got, first or now, now, msg)
                return

    readers = [threading.Thread(target=read, args=(k,)) for k in range(len(outs))]
    for r in readers:
        r.start()
    t0 = time.perf_counter()
    gate.set()
    for r in readers:
        r.join()
    for r in res:
        if not isinstance(r, Streamed):
            raise r if isinstance(r, Exception) else RuntimeError("a reader returned nothing")
    return t0, res  # type: ignore[return-value]
