"""Sentence embeddings with ONNX Runtime, and micro-batching of concurrent requests.

`OnnxEmbedder.embed(texts)` tokenises with the model's fast tokenizer and runs the exported
graph (pooling and normalisation inside), returning float32 rows of unit length.
`BatchingEmbedder` sits in front of it for the server: each caller blocks on `embed_one`, one
worker thread collects everything queued while the previous batch ran and embeds it in one
call, so N concurrent lookups cost about one batched forward pass instead of N.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
import unicodedata
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable, lone_surrogate
from services.semantic.onnx_export import ensure_onnx, export_identity

if TYPE_CHECKING:
    import onnxruntime as ort
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Printable ASCII and the whitespace a question holds: no control character (those a model
# drops) may pass the fast path of `OnnxEmbedder.unseen`.
_PLAIN_ASCII = re.compile(r"[\x20-\x7e\t\n\r]*")
# A long run of letters and digits: WordPiece reads a word past `max_input_chars_per_word`
# (100 in MiniLM) as one [UNK], so two texts differing only in such a word (a key, a hash, a
# string to decode) embedded alike while the fast path said every character was read. Any
# text with one takes the tokenizer's word (the slow path); 64 leaves room for other models.
_LONG_WORD = re.compile(r"[A-Za-z0-9]{64,}")


class _Unloadable(Exception):
    """A file of the ONNX export that does not load: `path`, and why (`why`)."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(f"{path}: {cause}")
        self.path = path
        self.why = f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"


def _load(folder: Path, opts: ort.SessionOptions) -> tuple[ort.InferenceSession, Tokenizer]:
    """The export's graph and tokenizer; `_Unloadable` names the file that failed."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidGraph, InvalidProtobuf
    from tokenizers import Tokenizer

    try:
        sess = ort.InferenceSession(str(folder / "model.onnx"), opts,
                                    providers=["CPUExecutionProvider"])
    except (InvalidProtobuf, InvalidGraph) as e:
        # Only a file that does not parse: out of memory, say, would not be mended
        # by an export.
        raise _Unloadable(folder / "model.onnx", e) from e
    path = folder / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        raise _Unloadable(path, e) from e
    return sess, tok


def _load_export(model_dir: str, cache_dir: str, name: str, exporter: str,
                 opts: ort.SessionOptions) -> tuple[ort.InferenceSession, Tokenizer, Path]:
    """The graph and tokenizer of `model_dir`'s export (`ensure_onnx`), and its folder; a
    cached export that does not load is exported again, once.

    Raises:
        ValueError: the export does not load though just exported (naming the file).
    """
    from services.semantic import onnx_export

    before = onnx_export.exports_done
    folder = ensure_onnx(model_dir, cache_dir, name, exporter=exporter)
    loaded = export_identity(folder)
    try:
        sess, tok = _load(folder, opts)
    except _Unloadable as e:
        if onnx_export.exports_done != before:
            # Exported by this very call (its digest did not match, say): exporting it
            # again would make the same file.
            raise ValueError(
                f"{e.path} cannot be loaded though just exported ({e.why}); it is made "
                f"from the model folder {model_dir}: check or replace that folder "
                "(TIERCACHE_SEMANTIC_MODEL_DIR)") from e.__cause__
        # A cached export damaged but of the size meta.json records (bit rot, a bad
        # restore), or an older export (no digests in meta.json) whose tokenizer.json is
        # damaged or gone, passed ensure_onnx's checks: every start then failed on it.
        # Exported again, once.
        log.warning("%s cannot be loaded (%s): exporting it again", e.path, e.why)
        folder = ensure_onnx(model_dir, cache_dir, name, broken=loaded, exporter=exporter)
        try:
            sess, tok = _load(folder, opts)
        except _Unloadable as again:
            # Not the cache's: a fresh export fails as well (the model folder's own file
            # is damaged). One line naming both files, not a traceback at every start.
            raise ValueError(
                f"{again.path} cannot be loaded even when exported again ({again.why}); "
                f"it is made from the model folder {model_dir}: check or replace that "
                "folder (TIERCACHE_SEMANTIC_MODEL_DIR)") from again.__cause__
    return sess, tok, folder


class OnnxEmbedder:
    """An exported sentence-transformers model run by ONNX Runtime. Thread-safe."""

    def __init__(self, model_dir: str, cache_dir: str, name: str, threads: int = 0, *,
                 spinning: bool = True, exporter: str = "torchscript") -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # `SemanticConfig.onnx_spinning`: what spinning threads gain and cost.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        self._sess, self._tok, folder = _load_export(model_dir, cache_dir, name, exporter, opts)
        # The graph's only output: "embedding" when traced, another name from the dynamo
        # exporter (onnx_export._export_dynamo).
        self._output: str = self._sess.get_outputs()[0].name
        meta = json.loads((folder / "meta.json").read_text())
        self.name = name
        self.fingerprint: str = meta["fingerprint"]
        # What stored vectors are tagged with: another model (or other weights) under the
        # same name must not pass for this one; a new export of the same weights does.
        self.identity = f"{name}@{meta.get('weights', self.fingerprint)}"
        self.dim: int = int(meta["dim"])
        self.max_seq_length: int = int(meta["max_seq_length"])
        self._inputs: list[str] = list(meta["inputs"])
        self._tok.enable_truncation(self.max_seq_length)
        self._tok.enable_padding()
        # The same tokenizer, whole texts, for `unseen`.
        self._plain = Tokenizer.from_str(self._tok.to_str())
        self._plain.no_truncation()
        self._plain.no_padding()
        self._probe_tokenizer()

    def _probe_tokenizer(self) -> None:
        """What the tokenizer cannot read, found once: its unknown token, whether it strips
        accents, whether it reads all of printable ASCII, and the tokens it adds to a text."""
        tok_model = json.loads(self._tok.to_str()).get("model", {})
        unk = tok_model.get("unk_token")  # WordPiece, BPE
        # Unigram (SentencePiece, e.g. XLM-R-based multilingual models) stores the id.
        self._unk_id = self._tok.token_to_id(unk) if unk else tok_model.get("unk_id")
        # Whether the model reads every printable ASCII character: then an ASCII text has
        # nothing unseen, and `unseen` skips tokenising it (the common case, on every
        # lookup whose candidate would hit).
        # A normalizer that strips accents reads a decomposed accent (NFD "e" + U+0301) as
        # part of its letter; at a word's end the offsets stop before the mark, which then
        # looked unread, and "café" typed decomposed (macOS, iOS) missed its own entry.
        self._strips_marks = (self._plain.encode("cafe\u0301").ids
                              == self._plain.encode("cafe").ids)
        printable = [chr(c) for c in range(0x21, 0x7F)]
        self._reads_ascii = all(self.unseen_slow(c) == "" for c in printable)
        # Tokens a text gets beyond its own (e.g. [CLS] [SEP]), read from the empty text.
        self._specials = sum(self._tok.encode("").attention_mask)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeds `texts` in one forward pass -> float32 `[len(texts), dim]`."""
        return self.embed_checked(texts)[0]

    def exceeds_window(self, text: str) -> bool:
        """Whether `text` is longer than the `max_seq_length` tokens the model reads: its
        vector then says nothing of the rest, so it is like any text with the same start."""
        # Every token covers at least one byte of the text (WordPiece, byte-level BPE, and
        # SentencePiece but for its one dummy-prefix piece): short texts need no tokenising.
        room = self.max_seq_length - self._specials - 1
        if 4 * len(text) <= room or len(text.encode()) <= room:
            return False
        return bool(self._tok.encode(text).overflowing)

    def unseen(self, text: str) -> str:
        """The characters of `text` the model cannot read, in order: those it maps to its
        unknown token (emoji, scripts outside its vocabulary) or drops (control and format
        characters), whitespace aside. Two texts that differ only there embed identically."""
        if (self._reads_ascii and text.isascii() and _PLAIN_ASCII.fullmatch(text)
                and not _LONG_WORD.search(text)):
            return ""
        return self.unseen_slow(text)

    def unseen_slow(self, text: str) -> str:
        """`unseen` from the tokenizer's offsets, whatever the text."""
        enc = self._plain.encode(text)
        covered = bytearray(len(text))
        for tid, (a, b), special in zip(enc.ids, enc.offsets, enc.special_tokens_mask,
                                         strict=True):
            if not special and tid != self._unk_id and b > a:
                covered[a:b] = b"\x01" * (b - a)
        if self._strips_marks:
            for i in range(1, len(text)):
                if not covered[i] and covered[i - 1] and unicodedata.combining(text[i]):
                    covered[i] = 1
        return "".join(c for c, seen in zip(text, covered, strict=True)
                       if not seen and not c.isspace())

    def embed_checked(self, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        """`embed`, and for each text whether it was cut to the window (`exceeds_window`)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32), []
        enc = self._tok.encode_batch(texts)
        feeds = {
            "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
        }
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.array([e.type_ids for e in enc], dtype=np.int64)
        (out,) = self._sess.run([self._output], feeds)
        out = np.asarray(out, dtype=np.float32)
        # Unit length whatever the folder: one without a Normalize module gives vectors of
        # norm 5-7, and an inner product over those reads as similarity 1.0 for anything.
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(out, dtype=np.float32), [bool(e.overflowing) for e in enc]


def _check_embeddable(text: object) -> None:
    """Refuses, in its caller's own thread, a text the tokenizer cannot take: a non-str, or a
    str with a lone surrogate (not UTF-8). Queued, it failed its whole batch, so every other
    caller that happened to share it got the tokenizer's TypeError for a text of its own that
    embeds alone."""
    if not isinstance(text, str):
        raise TypeError(f"the text to embed must be a str, not {type(text).__name__}")
    at = lone_surrogate(text)
    if at is not None:
        raise InvalidArgument("text", f"not valid Unicode: a lone surrogate at character {at}")


def _asks(wanted: Callable[[], bool]) -> bool:
    """`wanted()`, taken as True when it fails: a broken predicate must not drop a caller."""
    try:
        return bool(wanted())
    except Exception:  # noqa: BLE001
        return True


class BatchingEmbedder:
    """Micro-batches concurrent `embed_one` calls onto one `OnnxEmbedder`.

    Args:
        inner: the embedder that does the work.
        max_batch: at most this many texts per forward pass.
        wait_ms: after the first request arrives, wait this long for more (0 = take only what
            is already queued; requests that arrive during a pass form the next batch).
    """

    def __init__(self, inner: OnnxEmbedder, max_batch: int = 32, wait_ms: float = 0.0) -> None:
        self.inner = inner
        self.dim = inner.dim
        self.name = inner.name
        self.identity = inner.identity
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000.0
        self.batches = 0
        self.batched_texts = 0
        self.dropped_texts = 0  # callers gone before their batch ran
        self._q: queue.SimpleQueue[tuple[str, Future, Callable[[], bool] | None] | None] = (
            queue.SimpleQueue())
        self.exceeds_window = inner.exceeds_window
        self.unseen = inner.unseen
        # Set by `close` with its stop mark queued, under `_put_lock`: no text is queued after
        # that mark (the worker has stopped by the time one would be taken).
        self._closed = False
        self._put_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="embed-batcher", daemon=True)
        self._thread.start()

    def embed_one(self, text: str, timeout: float | None = None) -> np.ndarray:
        """Embedding of one text (blocks until its batch has run)."""
        return self.embed_one_checked(text, timeout)[0]

    # `embed_one_checked` takes `wanted`: a caller gone by the time its batch runs is dropped.
    accepts_wanted = True

    def embed_one_checked(self, text: str, timeout: float | None = None,
                          wanted: Callable[[], bool] | None = None
                          ) -> tuple[np.ndarray, bool]:
        """`embed_one`, and whether the text was cut to the model's window. `wanted`: asked
        when the text's batch is about to run; False (the caller's deadline passed, or it
        cancelled) drops the text, and DeadlineExceeded is raised here. Under overload, texts
        of callers long gone were embedded all the same, and live lookups queued behind them
        (a 4 ms lookup took a second behind 32 dead long texts).

        Raises, without queuing: TypeError (not a str), InvalidArgument (not valid Unicode),
        Unavailable (`close` was called)."""
        _check_embeddable(text)
        fut: Future = Future()
        with self._put_lock:
            if self._closed:
                # Queued now, the text would wait for a worker that has stopped: a caller
                # without a timeout (every Lookup and Store, a gRPC handler still running
                # when `RunningService.stop` closes the embedder) blocked for good.
                raise Unavailable("the embedder is closed (the service is stopping)")
            self._q.put((text, fut, wanted))
        return fut.result(timeout)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeds a caller's own batch directly (used for bulk loads)."""
        return self.inner.embed(texts)

    def close(self) -> None:
        """Embeds what was queued, then stops the worker; later calls raise Unavailable."""
        with self._put_lock:
            if not self._closed:
                self._closed = True
                self._q.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            batch = [item]
            deadline = time.monotonic() + self.wait_s
            while len(batch) < self.max_batch:
                try:
                    left = deadline - time.monotonic()
                    nxt = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            live = []
            for t, f, wanted in batch:
                if wanted is not None and not _asks(wanted):
                    self.dropped_texts += 1
                    f.set_exception(DeadlineExceeded("the caller is gone; not embedded"))
                else:
                    live.append((t, f))
            if not live:
                continue
            try:
                vecs, cut = self.inner.embed_checked([t for t, _ in live])
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                for _, f in live:
                    f.set_exception(exc)
                continue
            self.batches += 1
            self.batched_texts += len(live)
            for i, (_, f) in enumerate(live):
                f.set_result((vecs[i], cut[i]))
