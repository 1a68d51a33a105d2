"""The thundering herd: N requests at the same instant, before anything is cached.

    python -m benchmarks.herd --address localhost:50051 [--quick] [--sizes 1,4,16]

Against a running stack (any replica count; its semantic tier on). For each N, and for each
case — one identical question (`same`), the same question under a shared ~680-token system
prompt (`same+system`), and N different questions under that system prompt (`system-only`)
— N greedy requests start together (a barrier), each case with text never sent before (a
fresh nonce), then a second wave of N right after. Printed per wave: the replicas used,
cached tokens per request, the TTFT of the first and last, the wall time against N x one
request's, semantic hits, answers coalesced (an identical request's model run, in flight,
gave them), the semantic entries added, prompt tokens the replicas computed
(kvpool Stats: prompt - cached, so a shared prefix prefilled k times shows as ~k x its
length), refusals, and whether every answer's token ids equal one computed from scratch
(every cache off) — they must. Bounded: at most max(sizes) requests in flight, 16 tokens each.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from collections import Counter

import grpc
from tiercache.v1 import common_pb2

from clients.python.client import TierCacheClient

MAX_TOKENS = 16
SYSTEM = ("You are the support assistant of a company that sells garden tools. " * 2 + " ".join(
    f"Rule {i}: answer politely, cite the product manual section {i}, and never promise a "
    "delivery date that the warehouse has not confirmed." for i in range(1, 23)))
OFF = common_pb2.CachePolicy(skip_semantic_lookup=True, skip_semantic_store=True,
                             skip_prefix_cache=True, skip_draft=True)


def messages(nonce: str, system: bool, question: str) -> list[dict[str, str]]:
    out = [{"role": "system", "content": f"[{nonce}] {SYSTEM}"}] if system else []
    q = question if system else f"[{nonce}] {question}"
    return out + [{"role": "user", "content": q}]


def kv_totals(c: TierCacheClient) -> dict:
    time.sleep(1.3)  # the orchestrator polls replicas every second
    s = c.stats()
    return {"computed": sum(r.prompt_tokens_total - r.cached_tokens_total for r in s.replicas),
            "requests": sum(r.requests_total for r in s.replicas),
            "entries": s.semantic.entries,
            "classes": (s.semantic_hits, s.prefix_hits, s.cold, s.coalesced)}


def burst(c: TierCacheClient, msgs: list[list[dict[str, str]]]) -> list[dict]:
    n = len(msgs)
    gate = threading.Barrier(n)
    out: list[dict] = [{} for _ in range(n)]

    def one(i: int) -> None:
        gate.wait()
        t0 = time.perf_counter()
        try:
            r = c.generate(msgs[i], max_tokens=MAX_TOKENS, return_token_ids=True,
                           session_id=f"herd-{uuid.uuid4().hex[:8]}")
            out[i] = {"ids": list(r.token_ids), "ttft": r.report.ttft_ms,
                      "cached": r.report.cached_tokens, "prompt": r.prompt_tokens,
                      "replica": r.report.replica_id or "-", "hit": r.report.semantic_hit,
                      "entry": r.report.semantic_entry_id,
                      "coalesced": r.report.route == "coalesced",
                      "wall": (time.perf_counter() - t0) * 1000}
        except grpc.RpcError as e:  # a refusal under the burst is a result
            out[i] = {"error": f"{e.code().name}: {e.details()}"}

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def wave(c: TierCacheClient, msgs) -> dict:
    before = kv_totals(c)
    t0 = time.perf_counter()
    res = burst(c, msgs)
    wall = (time.perf_counter() - t0) * 1000
    after = kv_totals(c)
    ok = [r for r in res if r]
    good = [r for r in ok if "error" not in r]
    ttfts = sorted(r["ttft"] for r in good)
    return {"n": len(msgs), "errors": [r["error"] for r in ok if "error" in r],
            "replicas": Counter(r["replica"] for r in good), "cached": [r["cached"] for r in good],
            "prompt": good[0]["prompt"] if good else 0,
            "ttft_first_ms": round(ttfts[0]) if ttfts else None,
            "ttft_last_ms": round(ttfts[-1]) if ttfts else None,
            "wall_ms": round(wall),
            "semantic_hits": sum(r["hit"] for r in good),
            # Answered whole by an identical request's model run in flight (coalescing).
            "coalesced": sum(r["coalesced"] for r in good),
            "entry_ids": len({r["entry"] for r in good if r["entry"]}),
            # Reports naming the entry their answer was stored as (what Feedback rates): a
            # follower names the one its flight's storer wrote.
            "entry_named": sum(1 for r in good if r["entry"]),
            "entries_added": after["entries"] - before["entries"],
            "tokens_computed": after["computed"] - before["computed"],
            "replica_requests": after["requests"] - before["requests"],
            # The orchestrator's Stats: semantic hits, prefix hits, cold, coalesced (they must
            # sum to N).
            "classes": [a - b for a, b in zip(after["classes"], before["classes"], strict=True)],
            "ids": [r.get("ids") for r in res]}


def case(c: TierCacheClient, name: str, n: int) -> dict:
    nonce = uuid.uuid4().hex[:8]
    system = name != "same"
    qs = ([f"Question {i}: how do I sharpen blade model {i}?" for i in range(n)]
          if name == "system-only" else ["How do I sharpen the blade of my lawn mower?"] * n)
    msgs = [messages(nonce, system, q) for q in qs]
    waves = [wave(c, msgs), wave(c, msgs)]
    refs, single = {}, []
    # After the waves (a reference first would have cached the prompt): every cache off, the
    # ids each answer must have, and one request's time from scratch.
    for q in dict.fromkeys(qs):
        t0 = time.perf_counter()
        refs[q] = list(c.generate(messages(nonce, system, q), max_tokens=MAX_TOKENS,
                                  return_token_ids=True, cache_policy=OFF).token_ids)
        single.append((time.perf_counter() - t0) * 1000)
    single_ms = sum(single) / len(single)
    for w in waves:
        w["exact"] = [ids == refs[q] for ids, q in zip(w.pop("ids"), qs, strict=True)].count(True)
        w["n_x_single_ms"] = round(n * single_ms)
    return {"case": name, "single_ms": round(single_ms), "wave1": waves[0], "wave2": waves[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default="localhost:50051")
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--cases", default="same,same+system,system-only")
    ap.add_argument("--quick", action="store_true", help="N = 4 only")
    a = ap.parse_args()
    sizes = [4] if a.quick else [int(x) for x in a.sizes.split(",")]
    if max(sizes) > 32:
        ap.error("--sizes: at most 32 requests a burst")
    with TierCacheClient(a.address, timeout=300) as c:
        for n in sizes:
            for name in a.cases.split(","):
                print(json.dumps(case(c, name, n)), flush=True)


if __name__ == "__main__":
    main()
