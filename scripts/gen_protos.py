#!/usr/bin/env python3
"""Compiles protos/tiercache/v1/*.proto into Python gRPC code (`tiercache.v1`).

The one protoc invocation that `make protos`, the container image and a plain wheel's build
(setup.py) all run, so the three cannot drift apart:

    python scripts/gen_protos.py OUT_DIR [--descriptors]

--descriptors also writes OUT_DIR/tiercache_descriptors.pb, a FileDescriptorSet with source
info, which server reflection serves so that `grpcurl describe` shows the .proto comments
(services/common/reflection.py); without it a set already in OUT_DIR is removed (it would be
stale). Needs only grpcio-tools.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESCRIPTOR_SET_NAME = "tiercache_descriptors.pb"


def proto_files(root: Path = ROOT) -> list[str]:
    """The .proto files, relative to `root/protos`'s parent (what protoc's -I expects)."""
    return sorted(str(p.relative_to(root)) for p in (root / "protos/tiercache/v1").glob("*.proto"))


def compile_protos(out: str | Path, descriptors: bool = False, root: Path = ROOT) -> None:
    """Writes the *_pb2.py / *_pb2.pyi / *_pb2_grpc.py modules of every proto under `out`.

    Raises:
        RuntimeError: no .proto files, or protoc failed (its messages are on stderr).
    """
    import grpc_tools
    from grpc_tools import protoc

    protos = proto_files(root)
    if not protos:
        raise RuntimeError(f"no .proto files under {root / 'protos/tiercache/v1'}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["grpc_tools.protoc", f"-I{root / 'protos'}", f"-I{well_known}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if descriptors:
        args += ["--include_source_info", "--include_imports",
                 f"--descriptor_set_out={out / DESCRIPTOR_SET_NAME}"]
    else:
        # A set left by an earlier run is the old protos': reflection serves it before the
        # compiled descriptors, so `grpcurl describe` showed a field removed or lacked one
        # added, and grpcurl refused to send a new field ("no known field").
        (out / DESCRIPTOR_SET_NAME).unlink(missing_ok=True)
    # protoc names files relative to an -I root: give it the paths below protos/.
    rc = protoc.main([*args, *(str(root / p) for p in protos)])
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc}) compiling {', '.join(protos)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/gen_protos.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output folder (created if missing)")
    ap.add_argument("--descriptors", action="store_true",
                    help=f"also write {DESCRIPTOR_SET_NAME} (with source info) for reflection")
    args = ap.parse_args(argv)
    try:
        compile_protos(args.out, args.descriptors)
    except RuntimeError as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return 1
    print(f"gen_protos: {len(proto_files())} protos -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
