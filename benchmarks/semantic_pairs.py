"""Your own labelled sentence pairs, scored by a running semantic shard as it serves them.

    .venv/bin/python -m benchmarks.semantic_pairs PAIRS [--address HOST:PORT]
        [--tiers strict,standard,relaxed] [--threshold X] [--limit N] [--json]

PAIRS: a CSV or tab-separated file whose last three columns are the cached text, the incoming
text and a label (1 = same meaning, so a hit is right; 0 = a hit would be a false hit); other
columns before them are ignored, and so is a first row whose label is not 0 or 1 (a header).
`../shared/data/qqp_val.csv` and `paws_wiki_dev.tsv` have that shape.

For each pair the first text is stored in a namespace of its own (tenant `pairs-<run>-<n>`)
and the second looked up in each tier, with `--threshold` as the explicit threshold if given
(the tier's name still picks the guard and the verifier); each namespace is invalidated after
its lookups. So the figures are the shard's own decisions under its settings (thresholds,
guard and verifier tiers, model), every rule included: run it on a test shard started with
the settings to try (`python -m services.semantic --tier-strict 0.98 ...`), not on a serving
one, whose least recently used entries the stores could evict. Per tier it prints the pairs,
hits right and wrong, precision, recall, the false-hit rate (hits among the label-0 pairs) and
how many candidates at or above the threshold the guard or verifier refused.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

TIERS = ("strict", "standard", "relaxed")


def read_pairs(path: Path) -> tuple[list[tuple[str, str, int]], int]:
    """The file's (cached, incoming, label) rows, and how many rows were skipped (fewer than
    three columns, or a label other than 0 / 1; a header row is skipped without counting)."""
    text = path.read_text(encoding="utf-8")
    delimiter = "\t" if text.split("\n", 1)[0].count("\t") else ","
    pairs: list[tuple[str, str, int]] = []
    skipped = 0
    # The text itself, not its lines: a quoted field may hold a newline (QQP's do), and a
    # row split there was counted skipped twice instead of read.
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter,
                        quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL)
    for n, row in enumerate(reader):
        if len(row) >= 3 and row[-1].strip() in ("0", "1") and row[-3].strip() \
                and row[-2].strip():
            pairs.append((row[-3], row[-2], int(row[-1].strip())))
        elif n > 0:
            skipped += 1
    return pairs, skipped


@dataclass
class Tally:
    """One tier's decisions over the pairs."""

    pairs: int = 0
    same: int = 0  # label-1 pairs
    true_hits: int = 0
    false_hits: int = 0
    refused: int = 0  # candidates at or above the threshold the guard or verifier refused
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, label: int, hit: bool, guard_rejected: bool, reason: str) -> None:
        self.pairs += 1
        self.same += label
        if hit:
            if label:
                self.true_hits += 1
            else:
                self.false_hits += 1
        elif guard_rejected:
            self.refused += 1
            # The check, not its figures ("numbers differ: 200 mg, 400 mg"; "word order
            # differs (5 breakpoints)"; "verifier score 0.872 below 0.880").
            kind = ("verifier score below the tier's cut" if reason.startswith("verifier score")
                    else reason.split(":")[0].split("(")[0].strip() or "(none said)")
            self.reasons[kind] = self.reasons.get(kind, 0) + 1

    def figures(self) -> dict:
        hits = self.true_hits + self.false_hits
        different = self.pairs - self.same
        return {"pairs": self.pairs, "same_meaning": self.same, "true_hits": self.true_hits,
                "false_hits": self.false_hits,
                "precision": self.true_hits / hits if hits else None,
                "recall": self.true_hits / self.same if self.same else None,
                "false_hit_rate": self.false_hits / different if different else None,
                "refused_by_guard_or_verifier": self.refused,
                "refusals_by_reason": dict(sorted(self.reasons.items(),
                                                  key=lambda kv: -kv[1]))}


def score(stub, pairs: Iterable[tuple[str, str, int]], tiers: tuple[str, ...],
          threshold: float = 0.0, run: str = "", metadata: tuple = ()) -> dict[str, Tally]:
    """Stores, looks up and invalidates each pair through `stub` (a SemanticCacheStub)."""
    from tiercache.v1 import semantic_pb2 as pb

    run = run or uuid.uuid4().hex[:8]
    out = {t: Tally() for t in tiers}
    for n, (cached, incoming, label) in enumerate(pairs):
        ns = pb.Namespace(tenant=f"pairs-{run}-{n}", model_id="pairs")
        stub.Store(pb.StoreRequest(namespace=ns, prompt=cached, answer="-"), metadata=metadata)
        try:
            for t in tiers:
                r = stub.Lookup(pb.LookupRequest(namespace=ns, text=incoming, tier=t,
                                                 threshold=threshold), metadata=metadata)
                out[t].add(label, r.hit, r.guard_rejected, r.guard_reason)
        finally:
            stub.Invalidate(pb.InvalidateRequest(namespace=ns), metadata=metadata)
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.semantic_pairs",
                                 description="Score labelled pairs on a running semantic "
                                             "shard (see the module docstring).")
    ap.add_argument("pairs", type=Path, help="CSV or TSV: ..., cached text, incoming text, "
                                             "label (1 same meaning, 0 not)")
    ap.add_argument("--address", default="127.0.0.1:50052", help="the semantic shard")
    ap.add_argument("--token", default="", help="its internal token, if it requires one")
    ap.add_argument("--tiers", default=",".join(TIERS), help="comma-separated tiers to score")
    ap.add_argument("--threshold", type=float, default=0.0,
                    help="explicit threshold (0 = each tier's own)")
    ap.add_argument("--limit", type=int, default=0, help="the first N pairs only (0 = all)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    tiers = tuple(t.strip() for t in a.tiers.split(",") if t.strip())
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        ap.error(f"--tiers: unknown tier(s) {', '.join(unknown) or '(none given)'}; expected "
                 f"some of {', '.join(TIERS)}")
    if a.limit < 0:
        ap.error(f"--limit must be >= 0, got {a.limit}")
    if not a.pairs.is_file():
        ap.error(f"{a.pairs}: no such file")
    pairs, skipped = read_pairs(a.pairs)
    if a.limit:
        pairs = pairs[:a.limit]
    if not pairs:
        ap.error(f"{a.pairs}: no row with a cached text, an incoming text and a 0/1 label")

    import grpc
    from tiercache.v1 import semantic_pb2 as pb
    from tiercache.v1 import semantic_pb2_grpc as pbg

    metadata = (("authorization", f"Bearer {a.token}"),) if a.token else ()
    with grpc.insecure_channel(a.address) as ch:
        try:
            # A threshold or tier the shard refuses is said once, before anything is stored.
            stub = pbg.SemanticCacheStub(ch)
            for t in tiers:
                stub.Lookup(pb.LookupRequest(namespace=pb.Namespace(tenant="pairs-check",
                                                                    model_id="pairs"),
                                             text="check", tier=t, threshold=a.threshold),
                            metadata=metadata, timeout=30)
            tallies = score(stub, pairs, tiers, a.threshold, metadata=metadata)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    figures = {t: tally.figures() for t, tally in tallies.items()}
    if a.json:
        print(json.dumps({"pairs_file": str(a.pairs), "rows_skipped": skipped,
                          "threshold": a.threshold or None, "tiers": figures}, indent=1))
        return 0
    if skipped:
        print(f"{skipped} rows skipped (fewer than 3 columns, or a label other than 0/1)")
    print("| tier | pairs | hits right/wrong | precision | recall | false-hit rate "
          "| refused by guard/verifier |")
    print("|---|---|---|---|---|---|---|")
    for t, f in figures.items():
        print(f"| {t}{f' @ {a.threshold:g}' if a.threshold else ''} | {f['pairs']} | "
              f"{f['true_hits']}/{f['false_hits']} | {_fmt(f['precision'])} | "
              f"{_fmt(f['recall'])} | {_fmt(f['false_hit_rate'])} | "
              f"{f['refused_by_guard_or_verifier']} |")
    for t, f in figures.items():
        if f["refusals_by_reason"]:
            print(f"{t} refusals: " + ", ".join(f"{k} {v}"
                                                for k, v in f["refusals_by_reason"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

