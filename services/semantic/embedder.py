"""Sentence embeddings with ONNX Runtime, and micro-batching of concurrent requests.

`OnnxEmbedder.embed(texts)` tokenises with the model's fast tokenizer and runs the exported
graph (pooling and normalisation inside), returning float32 rows of unit length.
`BatchingEmbedder` sits in front of it for the server: concurrent `embed_one` callers share
forward passes (the caller that finds the model idle embeds everything queued), so N concurrent
lookups cost about one batched forward pass instead of N.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from services.semantic.onnx_export import ensure_onnx

log = logging.getLogger(__name__)


class OnnxEmbedder:
    """An exported sentence-transformers model run by ONNX Runtime. Thread-safe."""

    def __init__(self, model_dir: str, cache_dir: str, name: str, threads: int = 0) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        folder = ensure_onnx(model_dir, cache_dir, name)
        meta = json.loads((folder / "meta.json").read_text())
        self.name = name
        self.fingerprint: str = meta["fingerprint"]
        self.dim: int = int(meta["dim"])
        self.max_seq_length: int = int(meta["max_seq_length"])
        self._inputs: list[str] = list(meta["inputs"])
        self._tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        self._tok.enable_truncation(self.max_seq_length)
        self._tok.enable_padding()
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._sess = ort.InferenceSession(str(folder / "model.onnx"), opts,
                                          providers=["CPUExecutionProvider"])

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeds `texts` in one forward pass -> float32 `[len(texts), dim]`."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        enc = self._tok.encode_batch(texts)
        feeds = {
            "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        }
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.array([e.type_ids for e in enc], dtype=np.int64)
        (out,) = self._sess.run(["embedding"], feeds)
        return np.ascontiguousarray(out, dtype=np.float32)


class BatchingEmbedder:
    """Micro-batches concurrent `embed_one` calls onto one `OnnxEmbedder`.

    Leader/follower, no worker thread: a caller that finds no forward pass running runs one
    itself, over every text queued so far (its own included); callers that arrive meanwhile
    queue up and wait, and the first of them to wake when that pass ends leads the next batch.
    So a lone request embeds on its own RPC thread — no hand-off to another thread and back,
    which on a loaded 2-core machine cost a scheduling delay each way — and N concurrent
    requests still share about one forward pass.

    Args:
        inner: the embedder that does the work.
        max_batch: at most this many texts per forward pass.
        wait_ms: a leader waits up to this long for the batch to fill (0 = take only what is
            already queued; requests that arrive during a pass form the next batch).
    """

    def __init__(self, inner: OnnxEmbedder, max_batch: int = 32, wait_ms: float = 0.0) -> None:
        self.inner = inner
        self.dim = inner.dim
        self.name = inner.name
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000.0
        self.batches = 0
        self.batched_texts = 0
        self._cv = threading.Condition()
        self._pending: deque[tuple[str, Future]] = deque()
        self._running = False
        self._closed = False

    def embed_one(self, text: str, timeout: float | None = None) -> np.ndarray:
        """Embedding of one text (blocks until its batch has run).

        Raises:
            RuntimeError: the embedder is closed. TimeoutError: `timeout` passed first.
        """
        fut: Future = Future()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            if self._closed:
                raise RuntimeError("embedder is closed")
            self._pending.append((text, fut))
            if self.wait_s > 0:
                self._cv.notify_all()  # a leader may be waiting for its batch to fill
        while not fut.done():
            batch = self._lead(fut, deadline)
            if batch:
                self._run(batch)
        return fut.result()

    def _lead(self, fut: Future, deadline: float | None) -> list[tuple[str, Future]]:
        """Waits until `fut` is done (returns []) or this caller may lead (returns a batch)."""
        with self._cv:
            while self._running and not fut.done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("embedding did not finish in time")
                self._cv.wait(left)
            if fut.done():
                return []
            if self.wait_s > 0 and len(self._pending) < self.max_batch:
                end = time.monotonic() + self.wait_s
                self._running = True  # hold the lead while the batch fills
                while len(self._pending) < self.max_batch and time.monotonic() < end:
                    self._cv.wait(end - time.monotonic())
            self._running = True
            n = min(self.max_batch, len(self._pending))
            return [self._pending.popleft() for _ in range(n)]

    def _run(self, batch: list[tuple[str, Future]]) -> None:
        try:
            vecs = self.inner.embed([t for t, _ in batch])
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
            for _, f in batch:
                f.set_exception(exc)
        else:
            for i, (_, f) in enumerate(batch):
                f.set_result(vecs[i])
        finally:
            with self._cv:
                self._running = False
                self.batches += 1
                self.batched_texts += len(batch)
                self._cv.notify_all()

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeds a caller's own batch directly (used for bulk loads)."""
        return self.inner.embed(texts)

    def close(self) -> None:
        """Refuses new requests; requests already queued are still served by their callers."""
        with self._cv:
            self._closed = True
