"""Rules of the engine that a mutation audit found unguarded: what its stats say and when,
the codes its refusals carry, and what it counts. The engine is stepped by hand (as in
test_contracts) where the moment matters."""

from __future__ import annotations

from services.kvpool.engine import Finished
from tests.kvpool.conftest import request
from tests.kvpool.test_contracts import by_hand, drive, prompt


def test_a_finished_requests_stats_are_out_before_its_result(make_engine) -> None:
    """Stats are computed before the result is put out: a caller who sees a request end sees
    its row and blocks released in stats() at once, not after the engine's next turn."""
    eng = make_engine(num_blocks=32, max_batch_size=1)
    by_hand(eng)
    _, out = eng.submit(request(prompt(6, 1), 6, rid="a", ignore_eos=True))
    _, waiting = eng.submit(request(prompt(6, 2), 2, rid="b"))
    eng._drain_inbox(block=False)
    eng._step()  # "a" prefills and takes the only row; "b" waits
    eng._publish_state()
    st = eng.stats()
    assert (st.running, st.waiting) == (1, 1) and st.blocks_in_use > 0
    while out.empty() or not isinstance(out.queue[-1], Finished):
        eng._step()  # no _publish_state: only finishing may update the stats
    st = eng.stats()
    assert (st.running, st.waiting, st.requests_total) == (0, 1, 1)
    assert st.blocks_in_use == 0
    drive(eng, [], lambda e: None)  # "b" too
