"""A seeded, documented chat workload for benchmarks and replays.

Shape (all counts configurable):
- `tenants` tenants, each with `prompts_per_tenant` system prompts of ~`system_tokens` tokens
  (text assembled from QQP questions, so it tokenizes like real prose);
- sessions pick a (tenant, system prompt) with Zipf weights (a few prompts are hot) and run
  `turns` user turns; each user turn is a QQP question;
- `sessions` fresh sessions, plus enough *paraphrased repeats* that they make up
  `repeat_fraction` of all requests. A repeat is: a new session whose first question is
  the QQP duplicate (question2) of an earlier session's first question (question1), in the same
  tenant and system prompt — the traffic the semantic tier exists for;
- arrivals follow a Poisson process whose rate follows a diurnal curve
  rate(t) = base * (1 + amplitude * sin(2π t / period)), so there are low-traffic windows for
  warm-up. `Request.at` is the arrival time in seconds.

A trace is a JSONL file of `Request`s (`save_trace` / `load_trace`); `tiercache replay` can
replay one against a running stack.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The labelled pairs beside the repository (never copied into it), or TIERCACHE_DATA_DIR, as
# services.semantic.labelled_data reads them (here an empty value counts as unset).
DATA = Path(os.environ.get("TIERCACHE_DATA_DIR")
            or Path(__file__).resolve().parent.parent.parent / "shared" / "data")


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 0
    tenants: int = 4
    prompts_per_tenant: int = 2
    system_tokens: int = 1000  # approximate, ~0.75 words per token
    sessions: int = 16
    turns: int = 3
    repeat_fraction: float = 0.2
    zipf_s: float = 1.1
    base_rate: float = 1.0  # sessions per second at the curve's mean
    amplitude: float = 0.8
    period_s: float = 600.0


@dataclass
class Request:
    """One user turn. `history` is filled in at replay time from the session's earlier turns."""

    at: float
    tenant: str
    session_id: str
    system_index: int
    turn: int
    question: str
    repeat_of: str = ""  # session id whose first question this paraphrases
    kind: str = "turn"  # "turn" | "repeat"


@dataclass
class Workload:
    spec: WorkloadSpec
    system_prompts: dict[str, list[str]]  # tenant -> system prompts
    requests: list[Request] = field(default_factory=list)

    def sessions(self) -> dict[str, list[Request]]:
        out: dict[str, list[Request]] = {}
        for r in self.requests:
            out.setdefault(r.session_id, []).append(r)
        return out


def load_qqp(path: Path | None = None) -> list[tuple[str, str, int]]:
    path = path or DATA / "qqp_val.csv"
    with open(path, newline="", encoding="utf-8") as f:
        return [(r["question1"], r["question2"], int(r["is_duplicate"]))
                for r in csv.DictReader(f)]


def _system_prompt(rng: random.Random, questions: list[str], tenant: str, i: int,
                   approx_tokens: int) -> str:
    head = (f"You are the assistant of {tenant}, deployment {i}. Follow the policies below, "
            "answer briefly and precisely.\nPolicies and reference notes:\n")
    words: list[str] = []
    target_words = int(approx_tokens * 0.72)
    while len(words) < target_words:
        words.extend(rng.choice(questions).split())
    return head + " ".join(words[:target_words])


def _arrivals(rng: random.Random, n: int, spec: WorkloadSpec) -> Iterator[float]:
    # Thinning of a Poisson process with the diurnal rate.
    t, peak = 0.0, spec.base_rate * (1 + spec.amplitude)
    made = 0
    while made < n:
        t += rng.expovariate(peak)
        rate = spec.base_rate * (1 + spec.amplitude * math.sin(2 * math.pi * t / spec.period_s))
        if rng.random() * peak <= rate:
            made += 1
            yield t


def generate(spec: WorkloadSpec, qqp: list[tuple[str, str, int]] | None = None) -> Workload:
    rng = random.Random(spec.seed)
    qqp = qqp if qqp is not None else load_qqp()
    dups = [(a, b) for a, b, d in qqp if d == 1]
    singles = [a for a, _, _ in qqp]
    tenants = [f"tenant-{i}" for i in range(spec.tenants)]
    prompts = {t: [_system_prompt(rng, singles, t, i, spec.system_tokens)
                   for i in range(spec.prompts_per_tenant)] for t in tenants}
    pairs = [(t, i) for t in tenants for i in range(spec.prompts_per_tenant)]
    weights = [1.0 / (k + 1) ** spec.zipf_s for k in range(len(pairs))]
    rng.shuffle(pairs)
    n_fresh = spec.sessions
    n_repeat = int(round(spec.repeat_fraction * n_fresh * spec.turns
                         / max(1e-9, 1.0 - spec.repeat_fraction)))
    times = list(_arrivals(rng, n_fresh + n_repeat, spec))
    fresh: list[tuple[str, int, str, str]] = []  # tenant, sys, sid, paraphrase of first q
    reqs: list[Request] = []
    order = ["fresh"] * n_fresh + ["repeat"] * n_repeat
    # Repeats come after at least one fresh session; shuffle the rest.
    tail = order[1:]
    rng.shuffle(tail)
    order = order[:1] + tail
    # Each repeat paraphrases a different earlier session: drawn with replacement, 6 of 12
    # repeats asked the first session's one paraphrase, so most "paraphrased repeats" were
    # exact repeats of an earlier repeat (hits by text). A repeat with no unrepeated session
    # before it swaps places with the next fresh session.
    order = _repeats_after_their_originals(order) if n_repeat <= n_fresh else order
    unrepeated: list[tuple[str, int, str, str]] = []
    for k, (kind, at) in enumerate(zip(order, times, strict=True)):
        sid = f"s{spec.seed}-{k}"
        if kind == "repeat" and fresh:
            if unrepeated:
                tenant, sysi, orig, para = unrepeated.pop(rng.randrange(len(unrepeated)))
            else:
                tenant, sysi, orig, para = rng.choice(fresh)
            reqs.append(Request(at, tenant, sid, sysi, 0, para, repeat_of=orig, kind="repeat"))
            continue
        tenant, sysi = rng.choices(pairs, weights)[0]
        q1, q2 = rng.choice(dups)
        fresh.append((tenant, sysi, sid, q2))
        unrepeated.append((tenant, sysi, sid, q2))
        for turn in range(spec.turns):
            q = q1 if turn == 0 else rng.choice(singles)
            # Later turns arrive after the user read the answer: a few seconds apart.
            reqs.append(Request(at + 5.0 * turn, tenant, sid, sysi, turn, q))
    reqs.sort(key=lambda r: (r.at, r.session_id, r.turn))
    return Workload(spec, prompts, reqs)


def _repeats_after_their_originals(order: list[str]) -> list[str]:
    """`order` with each "repeat" at a point where more fresh sessions than repeats came
    before it (moved later past the next "fresh" where not), so every repeat can paraphrase
    a session not repeated yet."""
    out = list(order)
    fresh = repeats = 0
    for i in range(len(out)):
        if out[i] == "repeat" and repeats >= fresh:
            j = out.index("fresh", i)
            out[i], out[j] = out[j], out[i]
        if out[i] == "fresh":
            fresh += 1
        else:
            repeats += 1
    return out


def save_trace(w: Workload, path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"spec": asdict(w.spec), "system_prompts": w.system_prompts}) + "\n")
        for r in w.requests:
            f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")


# Latest arrival a trace may give a request (about 11.6 days from the replay's start).
MAX_AT_S = 1e6
_REQUEST_TYPES = {"at": (int, float), "tenant": str, "session_id": str, "system_index": int,
                  "turn": int, "question": str, "repeat_of": str, "kind": str}


def load_trace(path: str | Path) -> Workload:
    """A trace written by `save_trace`. Raises ValueError naming the line and field of a value
    of the wrong type (a replay found it in a worker thread, after requests had gone out: a
    traceback, and every outcome lost)."""
    with open(path, encoding="utf-8") as f:
        head = _json_line(f.readline(), 1)
        reqs = [_request(_json_line(line, n), n)
                for n, line in enumerate(f, 2) if line.strip()]
    if not isinstance(head, dict) or "system_prompts" not in head or "spec" not in head:
        raise ValueError("line 1: expected the trace's header (system_prompts, spec)")
    prompts = head["system_prompts"]
    if not isinstance(prompts, dict) or not all(
            isinstance(t, str) and isinstance(ps, list) and all(isinstance(p, str) for p in ps)
            for t, ps in prompts.items()):
        raise ValueError("line 1: system_prompts must map each tenant to a list of texts")
    try:
        spec = WorkloadSpec(**head["spec"])
    except TypeError as e:  # a field unknown or missing, or not an object
        raise ValueError(f"line 1: spec: {e}") from None
    return Workload(spec, prompts, reqs)


def _json_line(text: str, line: int) -> object:
    """One line's JSON; an error names the trace's line (json.loads, given a line alone,
    called every error "line 1")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {line}: not JSON ({e.msg}, column {e.colno})") from None


def _request(fields: object, line: int) -> Request:
    if not isinstance(fields, dict):
        raise ValueError(f"line {line}: expected an object")
    for name, want in _REQUEST_TYPES.items():
        if name in fields:
            v = fields[name]
            if isinstance(v, bool) or not isinstance(v, want) or (
                    isinstance(v, float) and not math.isfinite(v)):
                raise ValueError(f"line {line}: {name} has the wrong type or value: {v!r}")
    at = fields.get("at", 0)
    if isinstance(at, (int, float)) and not 0 <= at <= MAX_AT_S:
        # 1e300 passed, and a timed replay's wait for it was an OverflowError in a worker.
        raise ValueError(f"line {line}: at must be in [0, {MAX_AT_S:g}] seconds, got {at!r}")
    unknown = sorted(set(fields) - set(_REQUEST_TYPES))
    missing = sorted(f.name for f in dataclasses.fields(Request)
                     if f.name not in fields and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if unknown or missing:
        raise ValueError(f"line {line}: " + "; ".join(
            ([f"unknown fields {unknown}"] if unknown else [])
            + ([f"missing fields {missing}"] if missing else [])))
    return Request(**fields)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write a seeded workload trace (JSONL).")
    ap.add_argument("--out", required=True)
    for f, v in asdict(WorkloadSpec()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    a = ap.parse_args(argv)
    spec = WorkloadSpec(**{f: getattr(a, f) for f in asdict(WorkloadSpec())})
    try:
        w = generate(spec)
    except FileNotFoundError as e:
        # The README's `python -m benchmarks.workload` from a checkout without ../shared was a
        # traceback.
        raise SystemExit(f"error: {e.filename}: not found: the workload's questions are the QQP "
                         "pairs of ../shared/data beside the repository (or set "
                         "TIERCACHE_DATA_DIR to the folder holding qqp_val.csv)") from None
    save_trace(w, a.out)
    print(f"wrote {len(w.requests)} requests in {len(w.sessions())} sessions to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
