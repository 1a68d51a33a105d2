"""Rules of `services/semantic/embedder.py` a mutation audit found unchecked: the window's
exact size and what says a text passed it, `unseen` over whole texts, and the batcher's
limits, waiting, closing and failures."""

from __future__ import annotations

import threading
import time
from functools import partial

import numpy as np
import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.semantic.embedder import BatchingEmbedder
from tests.semantic.test_embedder import _SlowInner
from tests.waits import wait_until


def test_the_window_is_max_seq_length_tokens_and_a_text_past_it_says_so(onnx_embedder):
    """'!' is one token each: a text of exactly `max_seq_length` tokens (with [CLS] [SEP]) is
    whole, one more is cut, and embed_checked, exceeds_window and the batcher's flag agree."""
    fits = onnx_embedder.max_seq_length - onnx_embedder._specials
    for n in range(fits - 3, fits + 3):
        text = "!" * n
        assert len(onnx_embedder._plain.encode(text).ids) == n + onnx_embedder._specials
        assert onnx_embedder.exceeds_window(text) is (n > fits), n
    assert onnx_embedder.embed_checked(["!" * fits, "!" * (fits + 1)])[1] == [False, True]
    b = BatchingEmbedder(onnx_embedder)
    try:
        assert b.embed_one_checked("!" * (fits + 1))[1] is True
        assert b.embed_one_checked("!" * fits)[1] is False
    finally:
        b.close()


def test_a_text_of_few_characters_but_many_tokens_is_not_taken_as_short(onnx_embedder):
    """A Hangul syllable is three tokens (its jamo) in three bytes: 252 characters of them
    overflow, so no count of characters alone may call a text short."""
    text = "각 " * 126
    assert bool(onnx_embedder._tok.encode(text).overflowing)
    assert onnx_embedder.exceeds_window(text)


def test_unseen_reads_the_whole_text_not_only_the_window(onnx_embedder):
    """What the model cannot read is asked of the whole text: a text past the window has its
    unread characters found after the cut too, and the read ones there are not unread."""
    text = "Où est le café? " * 100 + "\U0001f40d"
    assert onnx_embedder.exceeds_window(text)
    assert onnx_embedder.unseen(text) == "\U0001f40d"


def test_a_long_word_takes_the_slow_path_at_every_length(onnx_embedder):
    """A word past WordPiece's 100 characters is one [UNK]: at every length the fast path
    must answer as the tokenizer does (101 letters included, not only far longer words)."""
    for n in (63, 64, 100, 101, 110, 119, 150):
        text = "the key is " + ("a1b2c3" * 30)[:n]
        assert onnx_embedder.unseen(text) == onnx_embedder.unseen_slow(text), n
    assert onnx_embedder.unseen("k " + "x" * 101) == "x" * 101


def test_a_combining_mark_opening_the_text_is_unread(onnx_embedder):
    """A mark joins the letter before it; at the very start there is none (no wrap-around to
    the text's last character)."""
    assert onnx_embedder.unseen("\u0301x") == "\u0301"


def test_no_texts_embed_to_no_rows(onnx_embedder):
    """`[len(texts), dim]` float32, for an empty list too (no forward pass)."""
    vecs, cut = onnx_embedder.embed_checked([])
    assert vecs.shape == (0, onnx_embedder.dim) and vecs.dtype == np.float32 and cut == []


class _Recording(_SlowInner):
    """`_SlowInner` noting each batch's size; a text "boom" makes its batch raise."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def embed_checked(self, texts):
        self.sizes.append(len(texts))
        if "boom" in texts:
            raise ValueError("the forward pass failed")
        return super().embed_checked(texts)


def _queue_behind_a_running_batch(b: BatchingEmbedder, inner: _Recording, texts: list[str]):
    """Starts a batch that blocks in `inner`, then one caller per text (queued behind it)."""
    out: dict[str, object] = {}

    def call(text: str) -> None:
        try:
            out[text] = b.embed_one(text)
        except Exception as e:  # noqa: BLE001 - what the caller got
            out[text] = e

    inner.release.clear()
    threads = [threading.Thread(target=call, args=("first",))]
    threads[0].start()
    _until(lambda: inner.sizes == [1])  # that batch is running: the next ones queue
    for t in texts:
        threads.append(threading.Thread(target=call, args=(t,)))
        threads[-1].start()
    _until(lambda: b._q.qsize() == len(texts))
    return out, threads


# Waits until `cond()` (polled): sleeps of a fixed length let a late thread of a busy host join
# the wrong batch.
_until = partial(wait_until, timeout=30.0, what="timed out", every=0.005)


def test_a_batch_never_holds_more_than_max_batch_texts():
    inner = _Recording()
    b = BatchingEmbedder(inner, max_batch=2)
    try:
        out, threads = _queue_behind_a_running_batch(b, inner, [f"t{i}" for i in range(5)])
        inner.release.set()
        for t in threads:
            t.join(10)
        assert len(out) == 6 and sum(inner.sizes) == 6
        assert max(inner.sizes) == 2 and b.batches == len(inner.sizes)
    finally:
        inner.release.set()
        b.close()


def test_wait_ms_holds_a_batch_open_for_later_callers():
    """With wait_ms a text arriving after the first, within the wait, joins its batch
    (the wait is long, 5 s, so that a busy host cannot make the second late; the batch
    holds 2, so it closes as soon as the second has joined)."""
    inner = _Recording()
    inner.release.set()
    b = BatchingEmbedder(inner, max_batch=2, wait_ms=5000)
    try:
        threads = [threading.Thread(target=b.embed_one, args=(t,)) for t in ("a", "b")]
        threads[0].start()
        time.sleep(0.1)
        threads[1].start()
        for t in threads:
            t.join(10)
        assert inner.sizes == [2]
    finally:
        b.close()


def test_close_embeds_what_was_queued_then_stops_the_worker():
    inner = _Recording()
    b = BatchingEmbedder(inner, max_batch=8)
    out, threads = _queue_behind_a_running_batch(b, inner, ["q1", "q2", "q3"])
    closer = threading.Thread(target=b.close)
    closer.start()
    time.sleep(0.1)
    inner.release.set()
    for t in [*threads, closer]:
        t.join(10)
    assert sorted(out) == ["first", "q1", "q2", "q3"]
    assert all(isinstance(v, np.ndarray) for v in out.values())
    assert not b._thread.is_alive()


def test_a_failing_forward_pass_fails_its_callers_and_not_the_batcher():
    """Each caller of the failed batch gets its error; later batches run, and only batches
    that ran are counted (one whose callers were all gone runs none)."""
    inner = _Recording()
    b = BatchingEmbedder(inner, max_batch=8)
    try:
        out, threads = _queue_behind_a_running_batch(b, inner, ["boom", "with it"])
        inner.release.set()
        for t in threads:
            t.join(10)
        assert isinstance(out["boom"], ValueError) and isinstance(out["with it"], ValueError)
        assert b.batches == 1 and b.batched_texts == 1
        with pytest.raises(DeadlineExceeded):
            b.embed_one_checked("gone", timeout=10, wanted=lambda: False)
        assert b.batches == 1 and b.dropped_texts == 1
        assert b.embed_one("later", timeout=10).shape == (4,)
        assert b.batches == 2
    finally:
        inner.release.set()
        b.close()


def test_a_wanted_predicate_that_raises_keeps_its_caller():
    """A broken predicate must not drop a caller: its text is embedded."""
    inner = _Recording()
    inner.release.set()
    b = BatchingEmbedder(inner)
    try:
        vec, cut = b.embed_one_checked("asked", timeout=10, wanted=lambda: 1 / 0)
        assert vec.shape == (4,) and cut is False and inner.embedded == ["asked"]
    finally:
        b.close()


def test_onnx_threads_reaches_the_session():
    """TIERCACHE_SEMANTIC_ONNX_THREADS (`threads`): a count given is ONNX Runtime's intra-op
    thread count; 0 leaves its default."""
    from services.semantic.config import SemanticConfig, default_cache_dir
    from services.semantic.embedder import OnnxEmbedder

    cfg = SemanticConfig()
    emb = OnnxEmbedder(cfg.resolved_model_dir(), default_cache_dir(), cfg.resolved_model_name(),
                       threads=1)
    assert emb._sess.get_session_options().intra_op_num_threads == 1


class _Gated:
    """The real embedder; each batch first waits for `release` (so callers queue behind the
    one running), and its size is noted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.dim, self.name, self.identity = inner.dim, inner.name, inner.identity
        self.exceeds_window, self.unseen = inner.exceeds_window, inner.unseen
        self.release = threading.Event()
        self.sizes: list[int] = []

    def embed_checked(self, texts):
        self.sizes.append(len(texts))
        self.release.wait(10)
        return self.inner.embed_checked(texts)


def test_a_text_the_tokenizer_cannot_take_fails_only_its_own_caller(onnx_embedder):
    """A str with a lone surrogate (or not a str) made the tokenizer raise for its whole
    batch: a caller that shared the batch got a TypeError for a text that embeds alone. Such
    a text is refused in its own caller's thread, before it is queued."""
    gated = _Gated(onnx_embedder)
    b = BatchingEmbedder(gated, max_batch=8)
    out: dict[str, object] = {}

    def call(key: str, text) -> None:
        try:
            out[key] = b.embed_one_checked(text, timeout=20)
        except Exception as e:  # noqa: BLE001 - what the caller got
            out[key] = e

    calls = {"first": "first", "good": "a question", "surrogate": "a \udcff b", "bytes": b"x"}
    threads = {k: threading.Thread(target=call, args=(k, t)) for k, t in calls.items()}
    try:
        threads["first"].start()
        _until(lambda: gated.sizes == [1])  # that batch is running: the next ones queue
        for k in ("good", "surrogate", "bytes"):
            threads[k].start()
        # Queued, or (the fix) refused at once.
        _until(lambda: b._q.qsize() + ("surrogate" in out) + ("bytes" in out) == 3)
        gated.release.set()
        for t in threads.values():
            t.join(20)
        vec, cut = out["good"]
        want, want_cut = onnx_embedder.embed_checked(["a question"])
        np.testing.assert_allclose(vec, want[0], rtol=0, atol=1e-5)
        assert cut is want_cut[0] is False
        assert isinstance(out["surrogate"], InvalidArgument)
        assert isinstance(out["bytes"], TypeError)
        assert gated.sizes == [1, 1]
    finally:
        gated.release.set()
        b.close()


def test_a_call_after_close_is_refused_not_left_waiting():
    """Once `close` has queued its stop mark, a text queued behind it waited for a worker that
    had stopped: a caller without a timeout (every Lookup and Store) blocked for good. It is
    refused (Unavailable); a second close is harmless."""
    inner = _Recording()
    inner.release.set()
    b = BatchingEmbedder(inner)
    assert b.embed_one("before", timeout=10).shape == (4,)
    b.close()
    assert not b._thread.is_alive()
    with pytest.raises(Unavailable):
        b.embed_one_checked("after", timeout=2)
    b.close()
    assert inner.embedded == ["before"] and b._q.qsize() == 0
