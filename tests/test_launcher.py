"""The local launcher's stop: no child may outlive it, even when the stop is interrupted."""

import pytest

from services.launcher import Stack


class FakeProcess:
    def __init__(self, name: str, log: list, interrupt: bool = False) -> None:
        self.name, self.log, self.interrupt = name, log, interrupt

    def stop(self) -> None:
        self.log.append(("stop", self.name))
        if self.interrupt:  # a second Ctrl-C while this one drains
            raise KeyboardInterrupt

    def kill(self) -> None:
        self.log.append(("kill", self.name))


def test_an_interrupted_stop_still_kills_every_child():
    log: list = []
    stack = Stack(replicas=0)
    stack.procs = {n: FakeProcess(n, log, interrupt=(n == "kvpool-0"))
                   for n in ("prefix", "kvpool-0", "orchestrator")}
    with pytest.raises(KeyboardInterrupt):
        stack.stop()
    assert log[:2] == [("stop", "orchestrator"), ("stop", "kvpool-0")]  # drains first
    assert {n for op, n in log if op == "kill"} == {"prefix", "kvpool-0", "orchestrator"}
