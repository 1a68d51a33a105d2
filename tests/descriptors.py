"""Descriptor helpers the reflection tests share (the models' side): a file compiled into this
process, its import closure, and the symbols a file declares."""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf import descriptor_pb2, descriptor_pool


def compiled(name: str) -> descriptor_pb2.FileDescriptorProto:
    """The file `name` as compiled into this process (the default pool)."""
    p = descriptor_pb2.FileDescriptorProto()
    descriptor_pool.Default().FindFileByName(name).CopyToProto(p)
    return p


def closure(name: str) -> set[str]:
    """`name` and every file it imports, directly or not."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(d.name for d in descriptor_pool.Default().FindFileByName(n).dependencies)
    return seen


def symbols(f: descriptor_pb2.FileDescriptorProto) -> Iterator[str]:
    """Every fully-qualified symbol the file declares (the reflection protocol's symbols)."""
    def enum(scope, e):
        yield f"{scope}.{e.name}"
        for v in e.value:
            yield f"{scope}.{v.name}"  # enum values are the enum's siblings

    def message(scope, m):
        name = f"{scope}.{m.name}"
        yield name
        for x in [*m.field, *m.oneof_decl]:
            yield f"{name}.{x.name}"
        for n in m.nested_type:
            yield from message(name, n)
        for e in m.enum_type:
            yield from enum(name, e)

    for m in f.message_type:
        yield from message(f.package, m)
    for e in f.enum_type:
        yield from enum(f.package, e)
    for s in f.service:
        yield f"{f.package}.{s.name}"
        for m in s.method:
            yield f"{f.package}.{s.name}.{m.name}"
