"""Server reflection that carries the .proto comments, so `grpcurl describe` shows them.

The descriptors compiled into `*_pb2.py` have no source info (comments). `make protos` also
writes `gen/tiercache_descriptors.pb`, a FileDescriptorSet built with `--include_source_info`
(a wheel carries it as `tiercache/tiercache_descriptors.pb`, beside the generated package);
this module serves those file descriptors through the stock reflection servicer by handing it
a pool whose files copy themselves from that set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool

DESCRIPTOR_SET_NAME = "tiercache_descriptors.pb"
DESCRIPTOR_SET = Path(__file__).resolve().parents[2] / "gen" / DESCRIPTOR_SET_NAME


def descriptor_set_path() -> Path:
    """`gen/`'s set (a source checkout, the image), else the one a wheel installs beside the
    generated `tiercache` package."""
    if DESCRIPTOR_SET.exists():
        return DESCRIPTOR_SET
    import importlib.util

    spec = importlib.util.find_spec("tiercache")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DESCRIPTOR_SET_NAME
        if candidate.exists():
            return candidate
    return DESCRIPTOR_SET


class _FileWithSource:
    def __init__(self, fd: Any, raw: dict[str, bytes]) -> None:
        self._fd = fd
        self._raw = raw
        self.name = fd.name

    @property
    def dependencies(self) -> list[_FileWithSource]:
        return [_FileWithSource(d, self._raw) for d in self._fd.dependencies]

    def CopyToProto(self, proto: descriptor_pb2.FileDescriptorProto) -> None:  # noqa: N802
        raw = self._raw.get(self.name)
        if raw is None:
            self._fd.CopyToProto(proto)
        else:
            proto.ParseFromString(raw)


class SourceInfoPool:
    """Duck-typed DescriptorPool for the reflection servicer (only what it calls). With an
    empty `raw` (no descriptor set) it serves the compiled descriptors, method names too."""

    def __init__(self, raw: dict[str, bytes], pool: Any = None) -> None:
        self._raw = raw
        self._pool = pool or descriptor_pool.Default()

    def FindFileByName(self, name: str):  # noqa: N802
        return _FileWithSource(self._pool.FindFileByName(name), self._raw)

    def FindFileContainingSymbol(self, symbol: str):  # noqa: N802
        """The file declaring `symbol`, a method's (`pkg.Service.Method`) too: the reflection
        protocol names methods as symbols (`grpcurl describe pkg.Service.Method` asks for
        one), and protobuf's upb pool finds none ("Symbol not found")."""
        try:
            fd = self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            try:
                found = self._pool.FindServiceByName(service)
            except KeyError:
                found = None
            if found is None or method not in found.methods_by_name:
                raise
            fd = found.file
        return _FileWithSource(fd, self._raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def source_info_pool(path: Path | None = None) -> SourceInfoPool | None:
    """A pool serving commented descriptors, or None when the set was not generated."""
    path = descriptor_set_path() if path is None else path
    if not path.exists():
        return None
    fds = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
    return SourceInfoPool({f.name: f.SerializeToString() for f in fds.file})
