"""Rules of scripts/gen_protos.py (the one protoc run of `make protos`, the image and a wheel)
that a walk through changing a .proto found unguarded."""

from __future__ import annotations

from tests.scripts import load_script


def test_a_run_without_descriptors_leaves_no_stale_descriptor_set(tmp_path):
    """`python scripts/gen_protos.py gen` (no --descriptors) over a gen/ that `make protos`
    had filled kept the old tiercache_descriptors.pb, which reflection serves before the
    compiled code: grpcurl described the protos as they were, not as compiled."""
    gen = load_script("gen_protos")
    stale = tmp_path / gen.DESCRIPTOR_SET_NAME
    stale.write_bytes(b"old protos")
    gen.compile_protos(tmp_path)
    assert not stale.exists()
    assert (tmp_path / "tiercache/v1/prefix_pb2.py").is_file()
    gen.compile_protos(tmp_path, descriptors=True)
    assert stale.is_file() and stale.read_bytes() != b"old protos"
