"""The clients across a real fork() (gunicorn --preload workers, multiprocessing's "fork"), in
a child Python that forks (this test process runs a gRPC server: it is not forked itself). The
forked grandchild ends itself with SIGALRM; a hang fails the test at the child's timeout."""

from __future__ import annotations

import json

from tests import test_client_aio
from tests.procs import communicate_all, python_child

address = test_client_aio.address  # the fixture of test_client_aio: its Scripted served

# What each script starts with: `fork(child)` runs `child()` in a forked process bounded by
# SIGALRM, and answers how it ended ("exit 0", "signal 11") and what it printed.
FORK = """
import asyncio, gc, json, os, signal, sys
from clients.python.client import TierCacheClient
from clients.python.aio import AsyncTierCacheClient
address = json.loads(sys.argv[1])["address"]

def fork(child):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(15)
        os.close(r)
        try:
            said = repr(child())
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
        os.write(w, said.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()
    _, status = os.waitpid(pid, 0)
    ended = (f"exit {os.waitstatus_to_exitcode(status)}" if os.WIFEXITED(status)
             else f"signal {os.WTERMSIG(status)}")
    return ended, said
"""


def forking(script: str, address: str) -> dict:
    """The JSON the script prints last (after FORK's helpers)."""
    [(out, err)] = communicate_all([python_child(FORK + script, {"address": address})], 60)
    assert out.strip(), err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_sync_client_closed_in_a_forked_child_while_the_parent_calls(address):
    """An atexit close() in a gunicorn worker: the child's close() of its parent's channel,
    with a call of the parent's under way, hung (the child never exited). Now close() in a
    child only marks the client closed; the parent's calls go on."""
    out = forking("""
c = TierCacheClient(address)
s = c.stream("hang")
next(s)  # the parent's call is under way
ended, said = fork(c.close)
s.cancel()
print(json.dumps({"child": [ended, said], "parent": c.stats(timeout=10).requests_total}))
""", address)
    assert out == {"child": ["exit 0", "None"], "parent": 7}


def test_an_async_client_first_called_in_a_forked_child_serves_it(address):
    """Made at import, as the README shows, in a gunicorn --preload master: nothing of gRPC
    was open before the fork, yet every call in the worker was a RuntimeError. Its channel
    now binds it to the process of its first call; one opened before the fork still refuses
    the child's calls, naming the fork."""
    out = forking("""
c = AsyncTierCacheClient(address)  # at import: no channel yet
child = fork(lambda: asyncio.run(c.stats(timeout=10)).requests_total)
parent = asyncio.run(c.stats(timeout=10)).requests_total  # its channel opens in the parent
opened = fork(lambda: asyncio.run(c.stats(timeout=10)))
print(json.dumps({"child": child, "parent": parent, "opened": opened}))
""", address)
    assert out["child"] == ["exit 0", "7"] and out["parent"] == 7
    ended, said = out["opened"]
    assert ended == "exit 0" and said.startswith(
        "RuntimeError: AsyncTierCacheClient opened its channel in process "), said
    assert "before a fork()" in said


def test_an_async_client_closed_in_a_forked_child_leaves_the_parents_channel(address):
    """close() (then a gc) in a child of the parent's open grpc.aio channel crashed the child
    (SIGSEGV) or hung it, and hung the parent's later calls past their deadlines. Now the
    child only marks its copy closed; the parent's channel serves on."""
    out = forking("""
c = AsyncTierCacheClient(address)
loop = asyncio.new_event_loop()
loop.run_until_complete(c.stats(timeout=10))
def close_here():
    asyncio.new_event_loop().run_until_complete(c.close())
    gc.collect()
    return c._closed
child = fork(close_here)
after = loop.run_until_complete(asyncio.wait_for(c.stats(timeout=10), 15)).requests_total
print(json.dumps({"child": child, "parent": after}))
""", address)
    assert out == {"child": ["exit 0", "True"], "parent": 7}
