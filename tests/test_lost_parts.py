"""What the chaos soak found about a committed version whose parts are gone without their node
dying: a successor of a killed snapshot manager does not hold it, a corrupted shard fails to
load, and the erasure error that says so must reach the driver intact (it crosses a process).
Real SnapshotManager actors on an embedded Ray; the coordinator as the driver runs it."""

import pickle

import pytest

from elastic_llm.config import load_config
from elastic_llm.pipeline.transport import DeadlineExceeded, PeerLost
from elastic_llm.runtime.managers import RayManagers
from elastic_llm.snapshot.coordinator import SnapshotCoordinator
from elastic_llm.snapshot.erasure import TooManyErasuresError
from elastic_llm.snapshot.records import ShardInfo, ShardKey, VersionRecord

from .conftest import REPO

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("err", [
    TooManyErasuresError(3, 1, [0, 2], [1]),
    PeerLost(ShardKey(1, 0), "the peer died"),
    DeadlineExceeded(ShardKey(2, 1), 30.0),
])
def test_errors_raised_in_an_actor_survive_the_trip_to_the_driver(err):
    # Ray carries an actor's exception to the caller pickled; TooManyErasuresError used to come
    # back as "UnserializableException: Failed to deserialize exception", and recovery retried
    # the same plan until its budget ran out
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__


def shard(stage, node, version):
    return ShardInfo(ShardKey(stage, 0), version, 0, 8, (), "{}", node_id=node)


def test_a_manager_without_the_committed_version_counts_as_lost(ray_local):
    import ray

    from elastic_llm.snapshot.manager import SnapshotManager, Version

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["parallel.stages=2", "snapshot.parity=1"])
    coord = SnapshotCoordinator(cfg, RayManagers("elastic-llm-test", cfg.snapshot.codec), "lost01")
    alive = {"a", "b", "c"}
    handles = {n: ray.remote(SnapshotManager).remote(n) for n in sorted(alive)}
    coord.managers = dict(handles)
    coord.committed = VersionRecord(7, (("a", "b", "c"),), (shard(0, "a", 7), shard(1, "b", 7), shard(2, "c", 7)))

    def hold(node, versions):
        def put(self, vs):
            self.versions = {v: Version() for v in vs}
        ray.get(handles[node].__ray_call__.remote(put, versions))

    for n in alive:
        hold(n, [7])
    assert coord.dead_managers(alive) == frozenset()
    hold("b", [8])  # a successor of b's killed manager: it never took version 7
    assert coord.dead_managers(alive) == {"b"}
    coord.unloadable["c"] = 7  # c's shard of 7 failed its checksum when a recovery loaded it
    assert coord.dead_managers(alive) == {"b", "c"}
    coord.unloadable["c"] = 6  # an older version's failure does not count against 7
    assert coord.dead_managers(alive - {"a"}) == {"a", "b"}


def test_a_shard_that_fails_to_load_beyond_parity_asks_for_a_new_plan(ray_local):
    """The plan knew node c lost; a's shard then fails to load while restoring: two parts of the
    group gone, more than parity 1. That is news to the plan, so the controller must observe and
    plan again (now falling back), not give the run up as unrecoverable."""
    import ray

    from elastic_llm.recovery.policy import SourceLost
    from elastic_llm.snapshot.manager import SnapshotManager

    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["parallel.stages=2", "snapshot.parity=1"])
    coord = SnapshotCoordinator(cfg, RayManagers("elastic-llm-test", cfg.snapshot.codec), "lost02")
    coord.managers = {n: ray.remote(SnapshotManager).remote(n) for n in ("a", "b")}  # c's node is gone
    coord.committed = VersionRecord(7, (("a", "b", "c"),), (shard(0, "a", 7), shard(1, "b", 7)))
    with pytest.raises(SourceLost, match="failed to load"):
        coord.fetch_stage_state(0, 0, frozenset({"c"}))  # a's manager does not hold version 7
    assert coord.unloadable == {"a": 7} and coord.dead_managers({"a", "b"}) == {"a", "b"}  # b never took 7 either


def test_a_slow_manager_gets_a_second_deadline_and_each_lost_part_says_why(ray_local, monkeypatch):
    """A manager that answers late (a loaded node) is not lost: counting it lost can send the run
    back to the durable tier. One that never answers, or is gone, is lost, each with its reason."""
    import os
    import signal
    import threading

    import ray

    from elastic_llm.snapshot import census, coordinator
    from elastic_llm.snapshot.manager import SnapshotManager, Version

    for mod in (census, coordinator):  # the census's deadlines, and the broadcast's the coordinator builds
        monkeypatch.setattr(mod, "PING_S", 0.5)
    monkeypatch.setattr(census, "SLOW_PING_S", 4.0)
    cfg = load_config(f"{REPO}/jobs/tiny.yaml", ["parallel.stages=2", "snapshot.parity=1"])
    coord = SnapshotCoordinator(cfg, RayManagers("elastic-llm-test", cfg.snapshot.codec), "lost03")
    nodes = ("a", "b", "c", "d")
    handles = {n: ray.remote(SnapshotManager).remote(n) for n in nodes}
    coord.managers = dict(handles)
    coord.committed = VersionRecord(7, (nodes,), tuple(shard(i, n, 7) for i, n in enumerate(nodes)))

    def put(self, vs):
        self.versions = {v: Version() for v in vs}
        return os.getpid()

    pid = {n: ray.get(h.__ray_call__.remote(put, [7])) for n, h in handles.items()}
    os.kill(pid["a"], signal.SIGSTOP)  # answers 1.5 s late: within the second deadline
    os.kill(pid["b"], signal.SIGSTOP)  # does not answer at all
    threading.Timer(1.5, os.kill, (pid["a"], signal.SIGCONT)).start()
    ray.kill(handles["c"])  # asynchronous: a call can still be served until the process is gone
    with pytest.raises(ray.exceptions.RayActorError):
        while True:
            ray.get(handles["c"].held.remote(), timeout=10)
    try:
        why = coord.lost_parts(set(nodes) - {"d"})
    finally:
        os.kill(pid["b"], signal.SIGCONT)
    assert set(why) == {"b", "c", "d"}
    assert "did not answer within 4.5 s" in why["b"]
    assert "manager is gone" in why["c"] and why["d"] == "its node died"


def test_managers_started_one_by_one_share_one_remote_class_and_each_answers(ray_local):
    """Every manager start used to make a ``ray.remote(SnapshotManager)`` of its own, which Ray
    pickles and disassembles again before the actor can start; now one per process
    (:func:`elastic_llm.remote.remote_of`), with the per-start settings in ``.options``."""
    import ray

    from elastic_llm.remote import remote_of
    from elastic_llm.snapshot.manager import SnapshotManager

    assert remote_of(SnapshotManager) is remote_of(SnapshotManager)
    assert remote_of(SnapshotManager, num_cpus=0) is not remote_of(SnapshotManager)  # other settings: another remote class
    fleet = RayManagers("elastic-llm-test", "rs")
    node = ray.get_runtime_context().get_node_id()
    handles = [fleet.start(node, f"share-{i}", "share", 0.0) for i in range(2)]
    try:
        assert ray.get([h.held.remote() for h in handles], timeout=120) == [{}, {}]  # nothing held yet
    finally:
        for h in handles:
            fleet.end(h)
