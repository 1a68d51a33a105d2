"""The labelled sentence pairs that tune and measure the semantic tier, and bulk embedding.

Used by `python -m services.semantic.fit_verifier` and `python -m benchmarks.semantic`. The
data sits outside the repository (`../shared/data`, or `TIERCACHE_DATA_DIR`): QQP validation
pairs, PAWS-Wiki dev pairs and Chinese STS-B; a deployed service never reads it.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from services.semantic.config import default_cache_dir
from services.semantic.embedder import OnnxEmbedder

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("TIERCACHE_DATA_DIR", ROOT.parent / "shared" / "data"))
log = logging.getLogger(__name__)


def embed_all(emb: OnnxEmbedder, texts: list[str], batch: int = 64) -> np.ndarray:
    """Embeds many texts, batching texts of similar length together.

    Large inputs are cached on disk under <cache dir>/bench, keyed by the ONNX model's
    fingerprint and the texts, so a rerun does not spend minutes re-embedding the same data
    (embedding speed is measured separately, in `bench_embed`)."""
    path = None
    if len(texts) >= 2000:
        h = hashlib.blake2b(emb.fingerprint.encode(), digest_size=12)
        for t in texts:
            h.update(t.encode() + b"\0")
        path = Path(default_cache_dir()) / "bench" / f"semantic-emb-{h.hexdigest()}.npy"
        if path.is_file():
            # Cut short or damaged (a crash before its data reached the disk, a full disk, a
            # bad copy): np.load's ValueError was a traceback at every run, or a cached array
            # of another shape was returned; embedded again instead, and the file replaced.
            try:
                cached = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                log.warning("the cached embeddings %s cannot be read (%s): embedding again",
                            path, exc)
            else:
                if cached.shape == (len(texts), emb.dim) and cached.dtype == np.float32:
                    return cached
                log.warning("the cached embeddings %s hold a %s %s array, not %d x %d "
                            "float32: embedding again", path, cached.dtype, cached.shape,
                            len(texts), emb.dim)
    out = np.zeros((len(texts), emb.dim), np.float32)
    order = np.argsort([len(t) for t in texts], kind="stable")
    for i in range(0, len(texts), batch):
        idx = order[i:i + batch]
        out[idx] = emb.embed([texts[j] for j in idx])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, out)
        os.replace(tmp, path)
    return out


# ---- data -----------------------------------------------------------------------------------

def _data_file(name: str) -> Path:
    """`DATA / name`, or FileNotFoundError saying where the data is looked for: installed from a
    wheel, the default names a folder inside the venv (`lib/shared/data`), and the bare
    "[Errno 2]" said nothing of `TIERCACHE_DATA_DIR`."""
    path = DATA / name
    if not path.is_file():
        raise FileNotFoundError(
            f"labelled data file {path} not found: set TIERCACHE_DATA_DIR to the folder holding "
            "qqp_val.csv, paws_wiki_dev.tsv and stsb_zh_valid.tsv (default: ../shared/data "
            "beside a checkout)")
    return path


def load_qqp() -> list[tuple[str, str, int]]:
    with open(_data_file("qqp_val.csv"), newline="") as f:
        return [(r["question1"], r["question2"], int(r["is_duplicate"]))
                for r in csv.DictReader(f)]


def _tsv(name: str, columns: int) -> list[list[str]]:
    """Rows of a tab-separated data file that have exactly `columns` fields."""
    with open(_data_file(name), encoding="utf-8") as f:
        return [p for p in (line.rstrip("\n").split("\t") for line in f) if len(p) == columns]


def load_paws() -> list[tuple[str, str, int]]:
    """PAWS-Wiki dev pairs (sentence1, sentence2, label 0/1); malformed rows are skipped."""
    return [(p[1], p[2], int(p[3])) for p in _tsv("paws_wiki_dev.tsv", 4) if p[3].isdigit()]


def load_stsb_zh() -> list[tuple[str, str, float]]:
    """Chinese STS-B validation pairs (sentence1, sentence2, score 0-5)."""
    out = []
    for p in _tsv("stsb_zh_valid.tsv", 3):
        try:
            out.append((p[0], p[1], float(p[2])))
        except ValueError:  # malformed score: skip the row
            continue
    return out
