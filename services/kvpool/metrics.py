"""Prometheus metrics of a kvpool replica."""

from __future__ import annotations

from typing import Any

from services.common.metrics import SECONDS_BUCKETS, TotalCounter, counter, gauge, histogram

_SECONDS = SECONDS_BUCKETS


class KvMetrics:
    """Block states, hit tokens vs prompt tokens, TTFT and step-time histograms, batch size."""

    def __init__(self) -> None:
        # The states partition the pool (free + cached + pinned + in_use = capacity): its size
        # is a gauge of its own, else a sum over states counted every block twice.
        self.blocks = gauge("tiercache_kvpool_blocks",
                            "KV blocks by state (free, cached, pinned, in_use: they add up to "
                            "tiercache_kvpool_capacity_blocks; a pinned block a request reads "
                            "is in_use until it ends, its pin kept)", ("state",))
        self.capacity = gauge("tiercache_kvpool_capacity_blocks", "KV blocks in the pool")
        self.running = gauge("tiercache_kvpool_running", "Sequences running in the engine")
        self.waiting = gauge("tiercache_kvpool_waiting", "Sequences waiting for admission")
        # Counted at admission, as cached_tokens: a request refused, cancelled or past its
        # deadline before it was admitted adds to neither (the hit ratio's two sides agree).
        self.prompt_tokens = counter("tiercache_kvpool_prompt_tokens_total",
                                     "Prompt tokens of Generate requests admitted (once each, "
                                     "however often preempted; not those refused, cancelled or "
                                     "past their deadline while waiting)")
        self.cached_tokens = counter("tiercache_kvpool_cached_tokens_total",
                                     "Prompt tokens of Generate requests served from cached KV "
                                     "blocks")
        self.prefills = counter("tiercache_kvpool_prefills_total",
                                "Prefill calls (warm-up) completed")
        self.prefill_computed_tokens = counter("tiercache_kvpool_prefill_computed_tokens_total",
                                               "Prompt tokens computed by Prefill calls")
        self.evictions = TotalCounter(counter("tiercache_kvpool_evictions_total",
                                              "Blocks evicted"))
        self.preemptions = counter("tiercache_kvpool_preemptions_total",
                                   "Sequences preempted (recomputed later)")
        self.step_failures = counter("tiercache_kvpool_engine_step_failures_total",
                                     "Engine steps that raised; their running sequences failed "
                                     "with INTERNAL")
        self.draft_proposed = counter("tiercache_kvpool_draft_tokens_proposed_total",
                                      "Draft tokens verified by the model")
        self.draft_accepted = counter("tiercache_kvpool_draft_tokens_accepted_total",
                                      "Draft tokens accepted into answers (each saves a "
                                      "forward pass; an answer's last run, where it ends on a "
                                      "draft token, saves one fewer)")
        self.draft_withheld = counter("tiercache_kvpool_draft_tokens_withheld_total",
                                      "Draft tokens proposed but left out of a batch's forward "
                                      "(they would have cost every row more than they save)")
        self.draft_tree_forwards = counter("tiercache_kvpool_draft_tree_forwards_total",
                                           "Trees verified: a sequence's draft proposal and "
                                           "its alternatives in one forward")
        self.draft_tree_branch_wins = counter("tiercache_kvpool_draft_tree_branch_wins_total",
                                              "Trees whose accepted tokens came from an "
                                              "alternative, not the proposal")
        self.ttft_seconds = histogram("tiercache_kvpool_ttft_seconds",
                                      "Time from arrival to the first token", buckets=_SECONDS)
        self.step_seconds = histogram("tiercache_kvpool_step_seconds", "Engine forward time",
                                      ("kind",), buckets=_SECONDS)
        self.batch_size = histogram("tiercache_kvpool_batch_size", "Sequences per decode forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64))

    def observe(self, stats: Any) -> None:
        """Set the gauges from an EngineStats snapshot."""
        self.capacity.set(stats.blocks_total)
        self.blocks.labels("free").set(stats.blocks_free)
        self.blocks.labels("cached").set(stats.blocks_cached)
        self.blocks.labels("pinned").set(stats.blocks_pinned)
        self.blocks.labels("in_use").set(stats.blocks_in_use)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.evictions.update(stats.evictions_total)
