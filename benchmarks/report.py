"""Run the benchmarks with targets and write one report with tables and plots.

    python -m benchmarks.report --run [--quick]   # make bench / make bench-quick
    python -m benchmarks.report [--quick]         # only (re)write the report from results/

`--run` runs the six in BENCHES (kvpool, prefix_index, semantic, orchestrator, assisted,
simulate), each as `python -m benchmarks.<name>` (with `--quick`: its quick arguments, below).
The studies beside them (prefix_lapse, semantic_restart, device, step_profile) are not run
here; the report shows their result files where they exist.

Writes `benchmarks/results/REPORT.md` and its plots `benchmarks/results/report_*.png`.
Each benchmark writes its own JSON; the report only reads them. A benchmark whose JSON is
missing is reported as "not run" and nothing is plotted for it. With `--quick` the quick
results (`kvpool-quick.json`, `semantic_quick.json`, ...) are preferred, else the full ones;
every table names the file its figures come from.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks import stack_log_dir

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT  # where BENCHES' paths point (ROOT is pointed elsewhere by tests)
RESULTS = ROOT / "benchmarks" / "results"


class Bench(NamedTuple):
    name: str
    quick_args: tuple[str, ...]  # arguments under --quick
    full_names: tuple[str, ...]  # result files of a full run
    quick_names: tuple[str, ...]  # result files of a quick run
    quick_timeout_s: int
    full_timeout_s: int


BENCHES = [
    Bench("kvpool", ("--quick",), ("kvpool.json",), ("kvpool-quick.json",), 420, 3600),
    Bench("prefix_index", ("--quick", "--out", str(RESULTS / "prefix_index-quick.json")),
          ("prefix_index.json",), ("prefix_index-quick.json",), 300, 3600),
    Bench("semantic", ("--quick",), ("semantic.json",), ("semantic_quick.json",), 360, 3600),
    Bench("orchestrator", ("--quick", "--out", str(RESULTS / "orchestrator-quick.json")),
          ("orchestrator.json",), ("orchestrator-quick.json",), 600, 3600),
    Bench("assisted", ("--quick",), ("assisted.json",),
          ("assisted-quick.json", "assisted_quick.json"), 420, 3600),
    Bench("simulate", ("--quick",), ("simulate.json",), ("simulate-quick.json",), 300, 14400),
]


# -- running ------------------------------------------------------------------------------


def run_all(quick: bool, only: list[str] | None = None) -> dict[str, dict]:
    """Run each benchmark as `python -m benchmarks.<name>`; returns status per benchmark."""
    from tqdm import tqdm

    # A new folder per run: one fixed folder had two runs (side by side, or a rerun of a
    # failure) overwrite each other's logs.
    logs = stack_log_dir("report", "benchmark logs")
    status: dict[str, dict] = {}
    todo = [b for b in BENCHES if not only or b.name in only]
    bar = tqdm(todo, desc="benchmarks", unit="bench")
    for b in bar:
        bar.set_postfix_str(b.name)
        if not (ROOT / "benchmarks" / f"{b.name}.py").exists():
            status[b.name] = {"status": "not present", "wall_s": 0.0}
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{b.name}", *(b.quick_args if quick else ())]
        log = logs / f"{b.name}{'-quick' if quick else ''}.log"
        t0 = time.monotonic()
        timeout = b.quick_timeout_s if quick else b.full_timeout_s
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        try:
            with open(log, "w") as f:
                # The benchmark's own progress goes to its log; the bar here shows which one runs.
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout, env=env).returncode
            st = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            st = f"timed out after {timeout}s"
        wall = time.monotonic() - t0
        status[b.name] = {"status": st, "wall_s": round(wall, 1), "log": str(log),
                          "command": " ".join(["python", *cmd[1:]]).replace(str(ROOT) + "/", "")}
        tqdm.write(f"{b.name}: {st} in {wall:.0f}s (log {log})")
    return status


# -- reading ------------------------------------------------------------------------------


class Result(NamedTuple):
    data: dict
    path: Path
    quick: bool


def load(b: Bench, quick: bool) -> Result | None:
    """The benchmark's result, quick or full as asked (falling back to the other)."""
    order = ([(n, True) for n in b.quick_names] + [(n, False) for n in b.full_names]
             if quick else
             [(n, False) for n in b.full_names] + [(n, True) for n in b.quick_names])
    for name, q in order:
        p = RESULTS / name
        if p.exists():
            try:
                return Result(json.loads(p.read_text()), p, q or bool(
                    json.loads(p.read_text()).get("quick", False)))
            except (json.JSONDecodeError, OSError):
                continue
    return None


def _f(v: object, nd: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(head: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# prefix_index's targets are {"<figure> <op> <bound>": met} (or "<figure> within <d> of the
# <other>"), no value: the value is the result's own figure of that name.
_BOUND = re.compile(r"^(\w+) (<=|>=) (\S+)$")
_WITHIN = re.compile(r"^(\w+) within (\S+) of the (\w+)$")


def _figure(d: dict, name: str) -> float | None:
    v = d.get(name)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def targets_of(d: dict) -> list[tuple[str, object, str, bool | None]]:
    """(name, value, target, met) from the two shapes benchmarks use. A target given only as
    a verdict (`"bytes_per_block <= 250": true`) is shown as the others are, its value read
    from the result's figure of that name (the row had no value and the whole name, not the
    bound, in the goal column)."""
    out = []
    for k, v in (d.get("targets") or {}).items():
        if isinstance(v, dict):
            out.append((k, v.get("value"), str(v.get("target", "")), v.get("met")))
        elif isinstance(v, bool):
            if m := _BOUND.match(k):
                out.append((m[1], _figure(d, m[1]), f"{m[2]} {m[3]}", v))
            elif m := _WITHIN.match(k):
                a, b = _figure(d, m[1]), _figure(d.get(m[3]) or {}, m[1])
                out.append((f"{m[1]} difference from the {m[3]}",
                            None if a is None or b is None else abs(a - b), f"<= {m[2]}", v))
            else:
                out.append((k, None, k, v))
    return out


def _src(r: Result) -> str:
    return f"`{r.path.relative_to(ROOT)}`" + (" (quick run)" if r.quick else "")


# -- plots --------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, name: str, made: list[str]) -> str:
    path = RESULTS / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    made.append(name)
    return name


POLICY_LABEL = {"round_robin": "round-robin", "session_ring": "session ring",
                "prefix_uncapped": "prefix-aware, no cap", "tiercache": "TierCache",
                "tiercache_tiebreak": "TierCache + tie-break (proposal)"}


def plot_ttft(sim: Result | None, orch: Result | None, made: list[str]) -> str | None:
    if sim is None and orch is None:
        return None
    plt = _plt()
    n = (sim is not None) + (orch is not None)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4))
    axes = [axes] if n == 1 else list(axes)
    ax_i = 0
    if sim is not None:
        ax = axes[ax_i]
        ax_i += 1
        h = sim.data["ttft_hist"].get("tiercache") or next(iter(sim.data["ttft_hist"].values()))
        edges = h["bin_edges_s"]
        for cls, counts in h["counts"].items():
            tot = sum(counts) or 1
            xs = [edges[0] / 1.25] + edges
            ax.step(xs, [c / tot for c in counts], where="post", label=f"{cls} (n={tot:,})")
        ax.set_xscale("log")
        ax.set_xlabel("modelled TTFT (s)")
        ax.set_ylabel("fraction of requests in class")
        ax.set_title(f"Simulation ({sim.path.name}), TierCache policy, "
                     f"{sim.data['targets_at_replicas']} replicas", fontsize=9)
        ax.legend()
    if orch is not None:
        ax = axes[ax_i]
        variants = [v for v in ("tiercache", "round_robin", "caches_off") if v in orch.data]
        classes = sorted({c for v in variants for c in orch.data[v].get("ttft_p50_ms", {})})
        w = 0.8 / max(1, len(variants))
        for j, v in enumerate(variants):
            vals = [orch.data[v]["ttft_p50_ms"].get(c, 0) / 1000 for c in classes]
            ax.bar([i + j * w for i in range(len(classes))], vals, w, label=v)
        ax.set_xticks([i + w * (len(variants) - 1) / 2 for i in range(len(classes))], classes)
        ax.set_ylabel("TTFT p50 (s)")
        ax.set_title("Full stack (orchestrator benchmark), p50 by cache class")
        ax.legend()
    return _save(fig, "report_ttft_by_class.png", made)


def plot_hits_over_time(sim: Result, made: list[str]) -> str:
    plt = _plt()
    ref = str(sim.data["targets_at_replicas"])
    series = sim.data["series"][ref]
    fig, ax = plt.subplots(figsize=(9, 4))
    for p, s in series.items():
        xs = [(i + 0.5) * s["window_s"] / 3600 for i in range(len(s["token_hit_ratio"]))]
        ax.plot(xs, s["token_hit_ratio"], label=POLICY_LABEL.get(p, p))
    ax.set_ylim(0, 1)
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("prefix-cache token hit ratio")
    ax2 = ax.twinx()
    s0 = next(iter(series.values()))
    xs = [(i + 0.5) * s0["window_s"] / 3600 for i in range(len(s0["prompt_tokens"]))]
    ax2.fill_between(xs, [t / s0["window_s"] for t in s0["prompt_tokens"]], alpha=0.12,
                     color="gray", label="prompt tokens/s (diurnal load)")
    ax2.set_ylabel("prompt tokens / s")
    ax.set_title(f"Prefix tier hit ratio over time, {ref} replicas ({sim.path.name})")
    lines = ax.get_legend_handles_labels()
    l2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + l2[0], lines[1] + l2[1], fontsize=8, loc="lower right")
    return _save(fig, "report_hit_rates_over_time.png", made)


def plot_pool(sim: Result, made: list[str]) -> str:
    plt = _plt()
    ref = str(sim.data["targets_at_replicas"])
    series = sim.data["series"][ref]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for p, s in series.items():
        xs = [(i + 1) * s["window_s"] / 3600 for i in range(len(s["pool_cached_fraction"]))]
        line = axes[0].plot(xs, s["pool_cached_fraction"], label=f"{POLICY_LABEL.get(p, p)}")
        axes[0].plot(xs, s["pool_in_use_fraction"], ls="--", color=line[0].get_color())
        if any(s["index_nodes"]):
            axes[1].plot(xs, s["index_nodes"], label=POLICY_LABEL.get(p, p))
    axes[0].set_ylim(0, 1.05)
    axes[0].set_xlabel("simulated time (h)")
    axes[0].set_ylabel("fraction of pool blocks")
    axes[0].set_title("Pool occupancy: cached (solid), referenced by running requests (dashed)",
                      fontsize=9)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("simulated time (h)")
    axes[1].set_ylabel("index nodes (blocks)")
    axes[1].set_title("Prefix index size (policies that consult it)", fontsize=9)
    axes[1].legend(fontsize=8)
    return _save(fig, "report_pool_occupancy.png", made)


def plot_decode(kv: Result | None, assisted: Result | None, made: list[str]) -> str | None:
    if kv is None and assisted is None:
        return None
    plt = _plt()
    pairs = [p for p in (assisted.data.get("pairs") or []) if isinstance(p, dict)
             and {"wall_plain_s", "wall_draft_s", "b_tokens"} <= set(p)] if assisted else []
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(13 if pairs else 7, 4))
    ax = axes[0] if pairs else axes
    if pairs:
        xs = range(len(pairs))
        axes[1].bar([x - 0.2 for x in xs], [p["b_tokens"] / p["wall_plain_s"] for p in pairs],
                    0.4, label="without draft")
        axes[1].bar([x + 0.2 for x in xs], [p["b_tokens"] / p["wall_draft_s"] for p in pairs],
                    0.4, label="with the cached answer as draft")
        axes[1].set_xticks(list(xs), [f"pair {p.get('pair', i)}\nshare {p.get('share', '')}"
                                      for i, p in enumerate(pairs)], fontsize=7)
        axes[1].set_ylabel("decode tokens / s (batch 1)")
        axes[1].set_title(f"Decode with and without drafts ({assisted.path.name})", fontsize=9)
        axes[1].legend(fontsize=8)
    labels, vals = [], []
    if kv is not None:
        f = kv.data.get("figures", {})
        for k, lab in (("decode_tok_s_b1", "batch 1"), ("decode_tok_s_b8", "batch 8"),
                       ("decode_tok_s_b1_shared_1k", "b1, 1k shared prefix"),
                       ("decode_tok_s_b8_shared_1k", "b8, 1k shared prefix")):
            if isinstance(f.get(k), (int, float)):
                labels.append(lab)
                vals.append(f[k])
    ax.barh(labels, vals)
    ax.set_xlabel("decode tokens / s (aggregate)")
    ax.set_title("KV pool decode speed" + ("" if assisted else " (drafts: not measured)"),
                 fontsize=9)
    return _save(fig, "report_decode_speed.png", made)


def plot_semantic(sem: Result, made: list[str]) -> str | None:
    curve = sem.data.get("quality", {}).get("curve")
    if not curve:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    # Each curve point with the spelling check every tier applies (benchmarks.semantic._curve)
    ax.plot([c["recall"] for c in curve], [c["precision"] for c in curve],
            label="cosine (+ spelling check)")
    if "recall_guard" in curve[0]:
        ax.plot([c["recall_guard"] for c in curve], [c["precision_guard"] for c in curve],
                label="cosine + guard (+ spelling check)")
    for name, t in sem.data["quality"].get("tiers", {}).items():
        # Each tier where it serves by default (its `default` row: the verifier's in the
        # default config), not at its guard-only row.
        g = t.get(t.get("default", "guard_on")) or {}
        if "qqp_recall" in g:
            ax.scatter([g["qqp_recall"]], [g["qqp_precision"]], zorder=3)
            ax.annotate(f"{name} ({t.get('threshold')}, served)",
                        (g["qqp_recall"], g["qqp_precision"]),
                        fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("recall (QQP duplicates)")
    ax.set_ylabel("precision")
    ax.set_title("Semantic tier precision-recall (QQP validation pairs)")
    ax.legend()
    return _save(fig, "report_semantic_pr.png", made)


def plot_index(pi: Result, made: list[str]) -> str:
    plt = _plt()
    d = pi.data
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    keys = [("hash_us_mean", "hash"), ("match_us_mean", "match"), ("insert_us_mean", "insert")]
    ours = [d.get(k, 0) for k, _ in keys]
    trie = [d.get("trie", {}).get(k, 0) if k != "hash_us_mean" else 0 for k, _ in keys]
    xs = range(len(keys))
    axes[0].bar([x - 0.2 for x in xs], ours, 0.4, label="block index")
    axes[0].bar([x + 0.2 for x in xs], trie, 0.4, label="per-token trie")
    axes[0].set_xticks(list(xs), [lab for _, lab in keys])
    axes[0].set_ylabel("µs per request (mean)")
    axes[0].set_title("Index operation cost")
    axes[0].legend()
    axes[1].bar(["block index", "per-token trie"],
                [d.get("bytes_per_block", 0), d.get("trie_bytes_per_block", 0)])
    axes[1].set_ylabel("bytes per 16-token block")
    axes[1].set_title("Index memory")
    return _save(fig, "report_index.png", made)


def _numeric(d: object, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            if k in ("targets", "machine", "series", "ttft_hist"):
                continue
            out |= _numeric(v, f"{prefix}{k}.")
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix.rstrip(".")] = float(d)
    return out


# -- the report ---------------------------------------------------------------------------


def _ratio_of(c: object) -> object:
    return c.get("prefix_hit_token_ratio") if isinstance(c, dict) else None


def ceiling_text(ceil: dict) -> str:
    """The orchestrator benchmark's unbounded-cache ceiling in words. Results written before the
    ceiling was set against each run's own requests (no `round_robin_model_served`) divided by
    the higher of two ceilings over different request sets: that is said, not hidden."""
    mine, allr = _ratio_of(ceil.get("model_served")), _ratio_of(ceil.get("all_requests"))
    text = ("One cache with unbounded memory on the same workload (no router can reuse more): "
            f"token hit ratio {_f(mine)} over the requests the model answered in TierCache's "
            f"run, {_f(allr)} over all requests (reference only: hit ratios count the "
            "model-answered ones).")
    if "round_robin_model_served" in ceil:
        theirs = _ratio_of(ceil.get("round_robin_model_served"))
        text += (f" Over round-robin's model-answered requests it is {_f(theirs)}, "
                 f"{_f(ceil.get('ceiling_over_round_robin'))}x round-robin's ratio (like for "
                 "like; round-robin reaches "
                 f"{_f(ceil.get('round_robin_share_of_ceiling'))} of it); the most the routing "
                 f"ratio could have been is {_f(ceil.get('routing_ratio_ceiling'))}. TierCache "
                 f"reaches {_f(ceil.get('tiercache_share_of_ceiling'))} of the ceiling over its "
                 "own requests.")
    elif ceil.get("ceiling_over_round_robin") is not None:
        text += (f" This result (written before the ceiling was matched to each ratio's "
                 f"requests) gives {_f(ceil.get('ceiling_over_round_robin'))}x round-robin's "
                 f"ratio and TierCache at {_f(ceil.get('tiercache_share_of_ceiling'))} of it, "
                 "both against the higher of the two ceilings, not over the requests each "
                 "ratio counts; rerun the benchmark for matched figures.")
    return text


def _optional(path: Path) -> dict | None:
    """A result file's JSON, or None where that benchmark was not run."""
    return json.loads(path.read_text()) if path.exists() else None


def lapse_text(path: Path) -> list[str]:
    """The lapse benchmark (`python -m benchmarks.prefix_lapse`, not part of `--run`) in one
    paragraph, or nothing when it was not run."""
    d = _optional(path)
    if d is None:
        return []
    w = d.get("workload", {})
    return ["", f"A lapsed lease (`{path.relative_to(ROOT)}`): dropping a replica that held "
            f"{_f(w.get('blocks_held_by_lapsing_replica'))} blocks held the index lock "
            f"{_f(d.get('lapse_lock_ms'))} ms (the walk it replaced: "
            f"{_f(d.get('walk_clear_lock_ms'))} ms); the {_f(w.get('nodes_left_unheld'))} "
            f"nodes it left unheld were deleted in {_f(d.get('reap_steps'))} steps of at most "
            f"{_f(d.get('reap_step_ms_max'))} ms (median {_f(d.get('reap_step_ms_p50'))} ms), "
            "the lock free between them. Same blocks and saved hits as the walk: "
            f"{_f(d.get('same_blocks_and_saved_hits_as_the_walk'))}."]


def restart_text(path: Path) -> list[str]:
    """The semantic restart benchmark (`python -m benchmarks.semantic_restart`, not part of
    `--run`) in one paragraph, or nothing when it was not run."""
    d = _optional(path)
    if d is None:
        return []
    w = d.get("workload", {})
    return ["", f"A semantic shard's start (`{path.relative_to(ROOT)}`, "
            f"{_f(w.get('entries'))} entries in one namespace): building the HNSW graph "
            f"{_f(d.get('load_build_s'))} s, taking the one saved by the last clean stop "
            f"{_f(d.get('load_snapshot_s'))} s ({_f(d.get('start_speedup'))}x; "
            f"{_f(d.get('load_snapshot_catch_up_s'))} s with "
            f"{_f(d.get('catch_up_removed'))} entries removed and {_f(d.get('catch_up_added'))} "
            f"added since the save); the save {_f(d.get('save_s'))} s, "
            f"{_f(d.get('snapshot_mb'))} MB. Same 10 nearest entries from both: "
            f"{_f(d.get('same_top10'))}."]


def device_text(results: Path) -> list[str]:
    """The replica on a GPU, beside the same commands on a CPU (`python -m benchmarks.device`,
    `python -m benchmarks.step_profile`; neither part of `--run`, since CI has no GPU): a
    paragraph or table each, or nothing."""
    out = []
    for name in ("device_cuda.json", "device_cpu.json"):
        dev = results / name
        d = _optional(dev)
        if d is None:
            continue
        f = d.get("figures", {})
        out += ["", f"The replica in-process on {d.get('device_name')} (`{dev.relative_to(ROOT)}`, "
                f"torch {d.get('host', {}).get('torch')}; `{d.get('command')}`, "
                # From the file the study read them from: under --quick "above" is
                # assisted-quick.json, whose few pairs these are not.
                f"{_f(f.get('pairs'))} of the near pairs in "
                f"`{str(d.get('pairs_from', 'benchmarks/results/assisted.json')).split(' ')[0]}`"
                "): greedy tokens identical from "
                "scratch, from the pool's cache, with the near-miss draft, with an unrelated one "
                f"and batched: {_f(f.get('identical_outputs'))}; seeded sampling the same with a "
                f"draft: {_f(f.get('identical_sampled'))}. decode_speedup_in_process "
                f"{_f(f.get('decode_speedup_in_process'))} (no gRPC, unlike decode_speedup "
                f"above), forward_passes_per_token {_f(f.get('forward_passes_per_token'))}, "
                f"unrelated_slowdown {_f(f.get('unrelated_slowdown'))}, "
                f"{_f(f.get('ms_per_token_plain'))} ms per token without a draft; a forward of "
                f"17 tokens cost {_f((d.get('draft_forward_costs') or [None])[-1])}x one of 1 "
                f"(ladder {d.get('draft_ladder')})."]
    for name in ("step_profile_cuda.json", "step_profile_cpu.json"):
        path = results / name
        d = _optional(path)
        if d is None:
            continue
        rows = [[k, v.get("engine_ms_per_step"), v.get("model_ms_per_step"),
                 v.get("kernels_per_step", v.get("ops_per_step")), v.get("gpu_busy_ms_per_step")]
                for k, v in d.get("figures", {}).items()]
        # The file too, as every other table names it (the command alone named none).
        out += ["", f"A decode step on {d.get('device_name')} (`{path.relative_to(ROOT)}`; "
                f"`{d.get('command')}`):", "",
                _table(["batch", "engine ms", "transformers loop ms",
                        "kernels (GPU) / operators (CPU)", "GPU busy ms"], rows)]
    return out


def routes_table(orch: dict) -> list[str]:
    """Per variant and route: tokens the replica reused against what the router's index said it
    held when it chose (`expected`), and what had been evicted by arrival (`shortfall`). Older
    results without `expected_tokens` say so instead of showing zeros."""
    rows = []
    for v in ("tiercache", "round_robin"):
        for name, r in sorted((orch.get(v) or {}).get("routes", {}).items()):
            if not isinstance(r, dict):
                continue
            prompt = r.get("prompt_tokens") or 0
            rows.append([v, name, r.get("requests"), prompt, r.get("cached_tokens"),
                         round(r["cached_tokens"] / prompt, 3) if prompt else None,
                         r.get("expected_tokens"), r.get("shortfall_tokens")])
    if not rows:
        return []
    return ["Reuse by route (`routes` in the same file): `expected` is what the router's index "
            "said the chosen replica held when it chose, `shortfall` what that replica had "
            "evicted of it by the time the request arrived (– = a result written before these "
            "were recorded):", "",
            _table(["variant", "route", "requests", "prompt tokens", "cached tokens",
                    "cached share", "expected", "shortfall"], rows), ""]


# Figures of older `assisted` results that are no longer reported: the n-gram "oracle" was no
# bound (the engine beat it on some pairs); the hindsight bounds replace it.
ASSISTED_RETIRED = {"forward_passes_per_token_ngram_oracle"}


def assisted_notes(figs: dict, notes: dict) -> list[str]:
    """What the near pairs, the unrelated-draft and bound figures mean, beside the table."""
    out = []
    if "near_pairs" in notes and "near_pairs" in figs:
        out.append(f"near_pairs ({_f(figs.get('near_pairs'))}, "
                   f"{_f(figs.get('near_pairs_draft_from_own_question'))} drafted from their own "
                   f"A): {notes['near_pairs']}")
    if "unrelated_slowdown" in figs:
        line = (f"unrelated_slowdown {_f(figs.get('unrelated_slowdown'))} is wall time with an "
                "unrelated draft over without any draft, as the issue defines it. Any draft "
                "turns on prompt lookup, so it includes lookup's gain; the unrelated draft's own "
                "cost, against prompt lookup alone, is unrelated_draft_cost_vs_lookup_only "
                f"{_f(figs.get('unrelated_draft_cost_vs_lookup_only'))} (lookup alone vs no "
                f"draft: {_f(figs.get('lookup_only_speedup_vs_plain'))}x faster).")
        if "random_draft_slowdown" in figs:
            line += (" A draft of random token ids: random_draft_slowdown "
                     f"{_f(figs.get('random_draft_slowdown'))}, "
                     f"{_f(figs.get('random_draft_cost_vs_lookup_only'))} against lookup alone.")
        out.append(line)
    if "forward_passes_per_token_hindsight_bound" in figs:
        # The benchmark's note opens with "lower bounds, not estimates:" itself.
        out.append("forward_passes_per_token_hindsight_bound(_draft) are " + str(notes.get(
            "forward_passes_per_token_hindsight_bound",
            "lower bounds, not estimates: with hindsight, any draft position.")))
    known = (figs.get("replayed_speedup_by_ladder") or {}).get("hindsight_ranking")
    if isinstance(known, dict) and "forward_passes_per_token" in known:
        flat = known.get("flat_costs") or {}
        out.append(f"Replayed with hindsight ranking: {_f(known['forward_passes_per_token'])} "
                   f"forwards per token ({_f(known.get('speedup'))}x) at the served costs, "
                   f"{_f(flat.get('forward_passes_per_token'))} at flat ones; "
                   + str(notes.get("hindsight_ranking", "")))
    return out


def sim_section(sim: Result) -> list[str]:
    d = sim.data
    cmds = d.get("commands") or [d.get("command")]
    out = [f"Source: {_src(sim)}; command{'s' if len(cmds) > 1 else ''} `"
           + "` then `".join(map(str, cmds)) + "`"
           + f"; {_f(d.get('wall_s_total', d.get('wall_s')))} s of wall time on this machine"
           + ("" if d.get("complete", True) else " — **incomplete: some runs did not finish**")
           + "."]
    if d.get("notes"):
        out.append(d["notes"])
    c = d["config"]
    sessions = d.get("sessions", {})
    out.append(
        f"Traffic: sessions per cluster size {sessions or c['sessions']}, {c['turns']} turns "
        f"each plus paraphrased repeats ({c['repeat_fraction']:.0%} of requests), "
        f"{c['tenants']} tenants × {c['prompts_per_tenant']} system prompts of "
        f"~{c['system_tokens']} tokens (Zipf s={c['zipf_s']}), "
        f"{c['req_per_replica_s']} requests/s per replica at the diurnal mean "
        f"(amplitude {c['amplitude']}); pool {c['pool_blocks']} blocks × {c['block_size']} "
        f"tokens per replica; compute from {d['rates']['source']}; load = "
        f"{d.get('load_definition', 'requests per replica')}.")
    out.append("")
    rows = []
    for n, pols in sorted(d["results"].items(), key=lambda kv: int(kv[0])):
        for p, s in pols.items():
            rows.append([n, POLICY_LABEL.get(p, p), s["token_hit_ratio"], s["load_max_over_mean"],
                         s["busy_max_over_mean"], s["ttft_p50_s"], s["ttft_p99_s"],
                         s["index_peak_bytes"] / 2**20 if s["index_peak_nodes"] else None,
                         s["index_us_per_request"] if s["index_peak_nodes"] else None,
                         s["routes"].get("prefix", 0) / max(1, s["requests"])])
    out.append(_table(["replicas", "policy", "token hit ratio", "load max/mean (requests)",
                       "busy max/mean", "TTFT p50 s", "TTFT p99 s", "index MiB (peak)",
                       "index µs / request", "prefix-routed"], rows))
    out.append("")
    out.append(f"Targets at {d['targets_at_replicas']} replicas:")
    out.append("")
    out.append(_table(["target", "value", "goal", "met"],
                      [[k, v, t, m] for k, v, t, m in targets_of(d)]))
    return out


def write_report(quick: bool, status: dict[str, dict] | None = None) -> Path:
    res = {b.name: load(b, quick) for b in BENCHES}
    made: list[str] = []
    L: list[str] = ["# TierCache benchmark report", ""]
    L.append(f"Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC by "
             f"`python -m benchmarks.report{' --run' if status else ''}"
             f"{' --quick' if quick else ''}` on a {os.cpu_count()}-CPU machine shared with "
             "other work: absolute timings are noisy, ratios within one run are the figures "
             "to read. Nothing here is invented: a benchmark without a result file is "
             "'not run'.")
    L += ["", "## Benchmarks", ""]
    rows = []
    for b in BENCHES:
        r = res[b.name]
        st = (status or {}).get(b.name, {})
        tg = targets_of(r.data) if r else []
        rows.append([b.name, _src(r) if r else "not run", st.get("status", "–"),
                     st.get("wall_s"),
                     f"{sum(1 for t in tg if t[3])}/{len(tg)}" if tg else "–"])
    L.append(_table(["benchmark", "result", "this run", "wall s", "targets met"], rows))
    # A quick run measures less (semantic's latency at 5k entries, not the 100k its targets
    # are set at): its "5/5" is not the full run's targets met. Name what it left unjudged.
    unjudged = []
    for b in BENCHES:
        r, full = res[b.name], load(b, False)
        if r and r.quick and full and not full.quick:
            judged = {t[0] for t in targets_of(r.data)}
            missing = [t[0] for t in targets_of(full.data) if t[0] not in judged]
            if missing:
                unjudged.append(f"{b.name}: {', '.join(missing)}")
    if unjudged:
        L += ["", "Targets met counts the targets each result file judges; a quick run leaves "
              "out those its reduced run does not measure (" + "; ".join(unjudged) + ")."]
    if status:
        L += ["", f"This run's benchmarks took {_f(sum(v['wall_s'] for v in status.values()))} s "
              "in all."]
    L.append("")
    # The quick commands as `--run --quick` runs them: `prefix_index --quick` alone writes no
    # file, so "with `--quick`" sent a reader to a run whose figures never reached this report.
    quick_cmds = ", ".join(
        "`" + " ".join(["python -m benchmarks." + b.name,
                        *(a.replace(str(REPO) + "/", "") for a in b.quick_args)]) + "`"
        for b in BENCHES)
    L.append("Commands: `python -m benchmarks.<name>` (full); quick: " + quick_cmds
             + "; `make bench` / `make bench-quick` run them all and this report.")

    # TTFT by cache class.
    L += ["", "## Time to first token by cache class", ""]
    orch, sim = res["orchestrator"], res["simulate"]
    # Plots and cluster-scale figures come from the full simulation when one exists (100k
    # sessions say more than a quick run); the quick run's own table is still shown below.
    simp = sim
    full_sim = RESULTS / "simulate.json"
    if quick and full_sim.exists():
        simp = Result(json.loads(full_sim.read_text()), full_sim, False)
    kv = res["kvpool"]
    if kv:
        f = kv.data.get("figures", {})
        L.append(f"KV pool through its gRPC API ({_src(kv)}): a {kv.data['shape']['prefix']}-"
                 f"token prefix + {kv.data['shape']['user']} new tokens; unique 512-token "
                 "prompts that hit nothing, on a replica with prefix caching on and off. TTFT "
                 "medians in seconds; the ratios (no unit) are the targets' (unique: the median "
                 "of per-pair ratios, not the ratio of the two medians).")
        L.append("")
        # Ratios in a column of their own: under "TTFT s" they read as seconds.
        L.append(_table(["case", "TTFT s", "ratio"], [
            ["cold (nothing cached)", f.get("ttft_cold_s"), None],
            ["prefix hit", f.get("ttft_hit_s"), None],
            ["hit / miss", None, f.get("ttft_ratio_hit_over_miss")],
            ["unique prompt, cache on", f.get("ttft_unique_cache_on_s"), None],
            ["unique prompt, cache off", f.get("ttft_unique_cache_off_s"), None],
            ["unique prompt, cache on / off", None,
             f.get("ttft_ratio_cache_on_over_off_unique")]]))
        L.append("")
    else:
        L.append("kvpool: not run.")
    if orch:
        L.append(f"Full stack, 2 replicas ({_src(orch)}), TTFT p50 ms by cache class:")
        L.append("")
        variants = [v for v in ("tiercache", "round_robin", "caches_off") if v in orch.data]
        classes = sorted({c for v in variants for c in orch.data[v].get("ttft_p50_ms", {})})
        L.append(_table(["variant", *classes, "all p50", "all p99", "prefix hit ratio",
                         "semantic hit rate", "load max/mean"],
                        [[v, *[orch.data[v]["ttft_p50_ms"].get(c) for c in classes],
                          orch.data[v].get("ttft_p50_ms_all"), orch.data[v].get("ttft_p99_ms_all"),
                          orch.data[v].get("prefix_hit_token_ratio"),
                          orch.data[v].get("semantic_hit_rate"),
                          orch.data[v].get("replica_load_max_over_mean")] for v in variants]))
        L.append("")
        ceil = orch.data.get("unbounded_cache_ceiling")
        if ceil:
            L.append(ceiling_text(ceil))
            L.append("")
        L.extend(routes_table(orch.data))
    else:
        L.append("orchestrator (full stack): not run.")
        L.append("")
    if simp:
        L.append(f"Modelled TTFT by class in the simulation ({_src(simp)}; cold = nothing "
                 "cached, warm = ≥ 80% of the prompt cached):")
        L.append("")
        ref = str(simp.data["targets_at_replicas"])
        L.append(_table(["policy", "class", "requests", "p50 s", "p99 s"],
                        [[POLICY_LABEL.get(p, p), c, v["n"], v["p50_s"], v["p99_s"]]
                         for p, s in simp.data["results"].get(ref, {}).items()
                         for c, v in s["ttft_by_class"].items()]))
        L.append("")
    png = plot_ttft(simp, orch, made)
    if png:
        L.append(f"![TTFT by cache class]({png})")

    # Hit rates per tier over time.
    L += ["", "## Hit rates per tier over time", ""]
    if simp:
        L.append(f"![hit rates over time]({plot_hits_over_time(simp, made)})")
        L.append("")
        L.append(f"Prefix tier from the simulation ({_src(simp)}, per time window). "
                 "The semantic tier is not simulated; its measured rate on the full stack is "
                 + (f"{orch.data['tiercache'].get('semantic_hit_rate')} (whole run, "
                    f"{_src(orch)})" if orch and "tiercache" in orch.data else "not run")
                 + "; no benchmark records it per time window yet.")
    else:
        L.append("simulate: not run.")

    # Decode with and without drafts.
    L += ["", "## Decode speed with and without drafts", ""]
    asst = res["assisted"]
    if kv:
        f = kv.data.get("figures", {})
        L.append(f"KV pool decode ({_src(kv)}): tokens/s summed over the batch's sequences.")
        L.append("")
        L.append(_table(["decode", "tokens/s"], [
            [k, f.get(k)] for k in ("decode_tok_s_b1", "decode_tok_s_b8",
                                    "decode_tok_s_b1_shared_1k", "decode_tok_s_b8_shared_1k")
            if k in f]))
        L.append("")
    if asst:
        cpu = (asst.data.get("machine") or {}).get("cpu_model")
        L.append(f"Cache-assisted generation, a cached near-miss answer as the draft "
                 f"({_src(asst)}; {asst.data.get('model', '')}"
                 + (f"; on {cpu}" if cpu else "") + "):")
        L.append("")
        figs = asst.data.get("figures") or _numeric(asst.data)
        L.append(_table(["figure", "value"], [[k, v] for k, v in figs.items()
                                              if isinstance(v, (int, float, bool))
                                              and k not in ASSISTED_RETIRED][:60]))
        notes = assisted_notes(figs, asst.data.get("notes") or {})
        if notes:
            L += ["", *notes]
    else:
        L.append("With drafts (cache-assisted generation): **not measured** — no "
                 "`assisted` benchmark result exists.")
    png = plot_decode(kv, asst, made)
    if png:
        L += ["", f"![decode speed]({png})"]
    L += device_text(RESULTS)

    # Semantic precision-recall.
    L += ["", "## Semantic tier precision–recall", ""]
    sem = res["semantic"]
    if sem:
        L.append(f"Source: {_src(sem)}.")
        L.append("")
        rows = []
        for name, t in sem.data.get("quality", {}).get("tiers", {}).items():
            # guard off / guard on / the learned verifier (guard + P(same) cut, out-of-fold):
            # the last is what the default config serves.
            for g, label in (("guard_off", "guard off"), ("guard_on", "guard on"),
                             ("verifier", "guard + verifier (5-fold grouped CV)")):
                x = t.get(g)
                if not x:
                    continue
                if t.get("default") == g:
                    label += ", default"
                rows.append([name, t.get("threshold"), label,
                             x.get("qqp_precision"), x.get("qqp_recall"),
                             x.get("paws_false_hit_rate"), x.get("paws_paraphrase_hit_rate")])
        L.append(_table(["tier", "threshold", "check", "QQP precision", "QQP recall",
                         "PAWS false-hit rate", "PAWS paraphrase hit rate"], rows))
        png = plot_semantic(sem, made)
        if png:
            L += ["", f"![semantic precision-recall]({png})"]
        lat = sem.data.get("latency", {})
        if lat:
            # lookup_p50/p99_ms exclude the server's embedding (the targets);
            # lookup_embed_p50_ms is the whole round trip.
            L += ["", _table(["entries", "index", "lookup p50 ms (excl. embedding)",
                              "lookup p99 ms (excl. embedding)", "lookup p50 ms (with embedding)",
                              "recall@1 vs exact"],
                             [[k, v.get("index"), v.get("lookup_p50_ms"), v.get("lookup_p99_ms"),
                               v.get("lookup_embed_p50_ms"), v.get("recall_at_1_vs_exact")]
                              for k, v in lat.items() if isinstance(v, dict)])]
        runs = sem.data.get("part_runs") or {}
        if runs:
            # Parts kept from earlier runs may come from another host (`--parts`).
            L += ["", "Parts of this file by run (`part_runs`): " + "; ".join(
                f"{p} {r.get('at', '?')[:10]} on {r.get('cpu_model', '?')}"
                for p, r in runs.items() if isinstance(r, dict)) + "."]
        zh = sem.data.get("chinese_stsb", {})
        if zh.get("verdict"):
            L += ["", f"Chinese (STS-B, {zh.get('pairs')} pairs): {zh['verdict']}"]
    else:
        L.append("semantic: not run.")
    L += restart_text(RESULTS / "semantic_restart.json")

    # Index throughput and memory.
    L += ["", "## Prefix index throughput and memory", ""]
    pi = res["prefix_index"]
    if pi:
        d = pi.data
        L.append(f"Source: {_src(pi)} ({d.get('workload', {}).get('requests', '?')} requests).")
        L.append("")
        L.append(_table(["figure", "block index", "per-token trie"], [
            ["hash µs / request", d.get("hash_us_mean"), None],
            ["match µs / request (mean)", d.get("match_us_mean"),
             d.get("trie", {}).get("match_us_mean")],
            ["match µs p99", d.get("match_us_p99"), None],
            ["insert µs / request", d.get("insert_us_mean"),
             d.get("trie", {}).get("insert_us_mean")],
            ["matches / s (one core, 1e6 / match µs)",
             1e6 / d["match_us_mean"] if d.get("match_us_mean") else None, None],
            ["bytes per 16-token block", d.get("bytes_per_block"),
             d.get("trie_bytes_per_block")],
            ["hit ratio", d.get("hit_ratio"), d.get("trie", {}).get("hit_ratio")],
            ["speedup vs trie (hash+match+insert)", d.get("speedup_vs_token_trie"), None]]))
        L += ["", f"![index]({plot_index(pi, made)})"]
    else:
        L.append("prefix_index: not run.")
    L += lapse_text(RESULTS / "prefix_lapse.json")
    if simp:
        ref = str(simp.data["targets_at_replicas"])
        s = simp.data["results"].get(ref, {}).get("tiercache")
        if s:
            L += ["", f"At cluster scale (simulation, {ref} replicas, TierCache policy): peak "
                  f"{_f(s['index_peak_nodes'])} nodes ≈ {_f(s['index_peak_bytes'] / 2**20)} MiB "
                  f"at {_f(simp.data['index_bytes_per_node']['value'])} B/node "
                  f"({simp.data['index_bytes_per_node']['source']}), "
                  f"{_f(s['index_us_per_request'])} µs of index work per request "
                  "(match + published events, in-process)."]

    # Pool occupancy.
    L += ["", "## Pool occupancy", ""]
    if kv:
        f = kv.data.get("figures", {})
        L.append(f"KV pool ({_src(kv)}): one 1k-prefix request holds "
                 f"{_f(f.get('blocks_in_use_one_request'))} blocks; 8 concurrent requests "
                 f"sharing it hold {_f(f.get('blocks_in_use_8_shared'))} "
                 f"({_f(f.get('shared_blocks_over_unshared'))} of unshared).")
        L.append("")
    if simp:
        L.append(f"Simulation ({_src(simp)}):")
        L.append("")
        L.append(f"![pool occupancy]({plot_pool(simp, made)})")
    else:
        L.append("simulate: not run.")

    # Routing simulation.
    L += ["", "## Routing at cluster size (simulation)", ""]
    if sim:
        L += sim_section(sim)
        if simp is not sim:
            L += ["", "### Full run", ""]
            L += sim_section(simp)
    else:
        L.append("simulate: not run.")

    # Every target of every benchmark.
    L += ["", "## All targets", ""]
    rows = []
    for b in BENCHES:
        r = res[b.name]
        if r is None:
            rows.append([b.name, "not run", None, "", None])
            continue
        for k, v, t, m in targets_of(r.data):
            rows.append([b.name + (" (quick)" if r.quick else ""), k, v, t, m])
    L.append(_table(["benchmark", "target", "value", "goal", "met"], rows))
    if asst:
        # unrelated_slowdown mixes prompt lookup's gain with the draft's cost: say so here too.
        figs = asst.data.get("figures") or {}
        L += ["", *(f"assisted: {n}" for n in assisted_notes(figs, {})
                    if n.startswith("unrelated_slowdown"))]
    L.append("")
    path = RESULTS / "REPORT.md"
    path.write_text("\n".join(L) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="store_true", help="run the benchmarks first")
    ap.add_argument("--quick", action="store_true", help="each benchmark's --quick version")
    ap.add_argument("--only", nargs="*", default=None, help="run only these benchmarks")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    status = run_all(a.quick, a.only) if a.run else None
    path = write_report(a.quick, status)
    print(f"wrote {path} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
