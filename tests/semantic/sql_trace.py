"""Counts the SQLite transactions a store runs (each one is a commit, and an fsync under
synchronous=FULL): the tests of bulk writes assert how many, never how long they take."""

from __future__ import annotations

from services.semantic.store import EntryStore


class SqlTrace:
    """Records every statement run on `store`'s connection from now on."""

    def __init__(self, store: EntryStore) -> None:
        self.statements: list[str] = []
        store._db.set_trace_callback(self.statements.append)

    def transactions(self, prefix: str) -> list[list[str]]:
        """The transactions that ran a statement starting with `prefix`: BEGIN ... COMMIT, or
        a statement run on its own (the connection autocommits)."""
        out: list[list[str]] = []
        cur: list[str] | None = None
        for s in self.statements:
            word = s.split(None, 1)[0].upper() if s.strip() else ""
            if word == "BEGIN":
                cur = []
            elif word in ("COMMIT", "END", "ROLLBACK"):
                if cur is not None:
                    out.append(cur)
                cur = None
            elif cur is not None:
                cur.append(s)
            else:
                out.append([s])
        return [t for t in out if any(s.upper().startswith(prefix.upper()) for s in t)]
