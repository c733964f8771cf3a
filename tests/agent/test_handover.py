"""A rank handed over while the old group still runs (scenario S09: a drained member trains on
until the decision removes it, and a late spare joins meanwhile), with live agents.

A commit made in the old group after a decided change gave the ranks to others is refused, so
the plan's ``resume_step`` (fixed from each survivor's progress at the decision) is never behind
a step a survivor applied. A change that only admits a spare keeps the group of the change
before it (``group_id``), at every member.
"""

from __future__ import annotations

from tests.agent.cluster import LocalCluster


async def test_a_commit_in_the_old_group_after_the_decision_is_refused():
    cluster = LocalCluster(4, 1, seed=5)
    await cluster.start()
    old = tuple(cluster.configuration.ranks)
    changes = []
    cluster[1].add_listener(changes.append)
    try:
        assert all(cluster[m].report_commit(5, old) for m in (1, 2, 3, 4))
        await cluster[2].drain()  # rank 1 leaves; its group could go on committing
        assert cluster[1].report_commit(6, old)  # not decided yet: accepted
        await cluster.until(lambda: cluster[1].configuration.config_id == 1, timeout_s=15)
        new = tuple(cluster[1].configuration.ranks)
        assert new == (1, 5, 3, 4)
        assert not cluster[1].report_commit(7, old)  # its progress for the plan is fixed
        assert cluster[1].member.last_committed_step == 6
        assert cluster[1].phase == "collective"  # alive, waiting for the change
        await cluster.until(lambda: bool(changes), timeout_s=15)
        assert changes[0].plan.resume_step == 7  # survivors reported 6 or 5: nothing lost
        assert cluster[1].report_commit(7, new)  # the new group commits again
        await cluster.until(lambda: cluster[2].role == "removed", timeout_s=15)
        assert not cluster[2].report_commit(7, old) and not cluster[2].report_commit(7, new)
    finally:
        await cluster.stop()


async def test_a_join_after_a_handover_keeps_the_handover_group_id():
    cluster = LocalCluster(4, 1, seed=6)
    await cluster.start()
    changes: dict[int, list] = {m: [] for m in (1, 3, 4, 5)}
    for m, seen in changes.items():
        cluster[m].add_listener(seen.append)
    try:
        await cluster[2].drain()
        await cluster.until(lambda: all(seen for seen in changes.values()), timeout_s=15)
        await cluster.join(99)
        await cluster.until(lambda: all(len(seen) == 2 for seen in changes.values()),
                            timeout_s=15)
        for seen in changes.values():
            assert [(c.configuration.config_id, c.group_id) for c in seen] == [(1, 1), (2, 1)]
        assert cluster[99].role == "spare"
    finally:
        await cluster.stop()
