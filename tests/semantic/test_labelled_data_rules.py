"""Rules of `services/semantic/labelled_data.py` a mutation audit found unchecked (no test read
it): `embed_all` gives each text its own vector whatever the batching, and caches a large
input under <cache dir>/bench keyed by the model's fingerprint and the texts; the loaders skip
malformed rows; `TIERCACHE_DATA_DIR` names the data folder."""

from __future__ import annotations

import os
import subprocess
import sys
from hashlib import blake2b
from pathlib import Path

import numpy as np
import pytest

from services.semantic import labelled_data
from services.semantic.labelled_data import embed_all, load_paws, load_qqp, load_stsb_zh

ROOT = Path(__file__).resolve().parents[2]


class FakeEmbedder:
    """What embed_all needs of an OnnxEmbedder: a vector per text from its hash; the batches
    it was given are kept."""

    dim = 4

    def __init__(self, fingerprint: str = "fp-1") -> None:
        self.fingerprint = fingerprint
        self.batches: list[list[str]] = []

    @staticmethod
    def vector(text: str) -> np.ndarray:
        seed = int.from_bytes(blake2b(text.encode(), digest_size=4).digest(), "little")
        return np.random.default_rng(seed).standard_normal(4).astype(np.float32)

    def embed(self, texts: list[str]) -> np.ndarray:
        self.batches.append(list(texts))
        return np.stack([self.vector(t) for t in texts])


def test_each_text_gets_its_own_vector_in_batches_of_similar_length():
    rng = np.random.default_rng(0)
    texts = ["w" * int(n) + str(i) for i, n in enumerate(rng.integers(1, 300, 150))]
    emb = FakeEmbedder()
    out = embed_all(emb, texts, batch=16)
    np.testing.assert_array_equal(out, np.stack([emb.vector(t) for t in texts]))
    assert sorted(t for b in emb.batches for t in b) == sorted(texts)  # each once
    assert [len(b) for b in emb.batches] == [16] * 9 + [6]
    lengths = [sorted(len(t) for t in b) for b in emb.batches]
    assert all(a[-1] <= b[0] for a, b in zip(lengths, lengths[1:], strict=False))


def test_a_large_input_is_embedded_once_then_read_back_from_the_cache(tmp_path, monkeypatch):
    """Keyed by the model's fingerprint and the texts: another model, or the same characters
    split into other texts, is embedded again."""
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))
    texts = [f"question {i}" for i in range(2500)]
    first = FakeEmbedder()
    out = embed_all(first, texts)
    assert first.batches and len(list((tmp_path / "bench").glob("semantic-emb-*.npy"))) == 1
    again = FakeEmbedder()
    np.testing.assert_array_equal(embed_all(again, texts), out)
    assert again.batches == []  # from the cache
    other_model = FakeEmbedder("fp-2")
    embed_all(other_model, texts)
    assert other_model.batches
    split_otherwise = ["question 0q", "uestion 1"] + texts[2:]  # same characters in all
    emb = FakeEmbedder()
    got = embed_all(emb, split_otherwise)
    assert emb.batches and np.array_equal(got[0], emb.vector("question 0q"))
    assert sorted(p.name.count(".") for p in (tmp_path / "bench").iterdir()) == [1, 1, 1]


def test_a_small_input_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))
    embed_all(FakeEmbedder(), ["a", "b"])
    assert not (tmp_path / "bench").exists()


def test_malformed_rows_of_the_data_files_are_skipped(tmp_path, monkeypatch):
    """PAWS rows need 4 fields and a 0/1 label (the header is skipped), STS-B rows 3 fields
    and a number; QQP is read as CSV (quoted commas and new lines inside a question)."""
    monkeypatch.setattr(labelled_data, "DATA", tmp_path)
    (tmp_path / "paws_wiki_dev.tsv").write_text(
        "id\tsentence1\tsentence2\tlabel\n1\tA b.\tB a.\t0\n2\tonly\tthree\n"
        "3\tx\ty\t1\textra\n4\tC d.\tD c.\t1\n5\tE\tF\tyes\n", encoding="utf-8")
    assert load_paws() == [("A b.", "B a.", 0), ("C d.", "D c.", 1)]
    (tmp_path / "stsb_zh_valid.tsv").write_text(
        "sentence1\tsentence2\tscore\n一个女人在弹吉他。\t一个人在弹吉他。\t3.8\n"
        "a\tb\n" "c\td\t4.0\tmore\n" "e\tf\tnot-a-number\n", encoding="utf-8")
    assert load_stsb_zh() == [("一个女人在弹吉他。", "一个人在弹吉他。", 3.8)]
    (tmp_path / "qqp_val.csv").write_text(
        'question1,question2,is_duplicate\n"Why, then?","Why\nnot?",1\nA?,B?,0\n')
    assert load_qqp() == [("Why, then?", "Why\nnot?", 1), ("A?", "B?", 0)]


def test_the_data_folder_is_taken_from_tiercache_data_dir(tmp_path):
    env = dict(os.environ, TIERCACHE_DATA_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "gen")]))
    r = subprocess.run([sys.executable, "-c", "from services.semantic import labelled_data as "
                        "d; print(d.DATA)"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(tmp_path)


def test_a_damaged_cache_file_is_embedded_again_under_a_warning(tmp_path, monkeypatch, caplog):
    """A cached .npy cut short or of another shape (a crash, a full disk, a bad copy) was a
    ValueError traceback at every run, or returned as it was: it is embedded again, said once
    at WARNING, and the file replaced."""
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))
    texts = [f"question {i}" for i in range(2500)]
    want = embed_all(FakeEmbedder(), texts)
    (path,) = (tmp_path / "bench").iterdir()
    for damage in (lambda: path.write_bytes(path.read_bytes()[:1000]),
                   lambda: np.save(path, np.zeros((3, 4), np.float32))):
        damage()
        caplog.clear()
        emb = FakeEmbedder()
        with caplog.at_level("WARNING", logger="services.semantic.labelled_data"):
            np.testing.assert_array_equal(embed_all(emb, texts), want)
        assert emb.batches and len(caplog.records) == 1
        assert str(path) in caplog.records[0].getMessage()
        np.testing.assert_array_equal(np.load(path), want)


def test_a_missing_data_file_names_tiercache_data_dir(tmp_path, monkeypatch):
    """Installed from a wheel the default folder is inside the venv (`lib/shared/data`): a
    bare "[Errno 2] ... qqp_val.csv" said nothing of where to put the data."""
    monkeypatch.setattr(labelled_data, "DATA", tmp_path / "none")
    for load, name in ((load_qqp, "qqp_val.csv"), (load_paws, "paws_wiki_dev.tsv"),
                       (load_stsb_zh, "stsb_zh_valid.tsv")):
        with pytest.raises(FileNotFoundError, match=f"{name} not found: set TIERCACHE_DATA_DIR"):
            load()
