"""The step's links and the gradient all-reduce, in one process without Ray: real sockets on
loopback, one thread per actor."""

import inspect
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from elastic_llm.pipeline.collective import allreduce_sum, chunk_bounds
from elastic_llm.pipeline.executor import link_peers
from elastic_llm.pipeline.schedules import routes
from elastic_llm.pipeline.transport import Aborted, Msg, PeerLost, SocketTransport
from elastic_llm.snapshot.records import ShardKey

pytestmark = pytest.mark.timeout(60)


def linked(keys, generation=1):
    """SocketTransports for ``keys``, fully connected, at step 1."""
    ts = {k: SocketTransport(k) for k in keys}
    addresses = {k: t.address for k, t in ts.items()}
    with ThreadPoolExecutor(len(keys)) as pool:
        list(pool.map(lambda k: ts[k].connect(generation, {p: a for p, a in addresses.items() if p != k}), keys))
    for t in ts.values():
        t.begin(1, 30.0)
    return ts


def close(ts):
    for t in ts.values():
        t.close()


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_allreduce_gives_every_replica_the_bits_of_summing_in_replica_order(dp):
    keys = [ShardKey(0, r) for r in range(dp)]
    ts = linked(keys)
    rng = np.random.default_rng(dp)
    grads = [rng.standard_normal(10_007).astype(np.float32) for _ in range(dp)]  # not divisible by dp
    try:
        with ThreadPoolExecutor(dp) as pool:
            out = list(pool.map(lambda r: allreduce_sum(ts[keys[r]], grads[r], keys, r), range(dp)))
    finally:
        close(ts)
    ref = torch.from_numpy(grads[0].copy())
    for g in grads[1:]:
        ref += torch.from_numpy(g)
    for r in range(dp):
        np.testing.assert_array_equal(out[r], ref.numpy())
    # a different summation order gives other bits: the fixed order is what keeps replicas equal
    other = torch.from_numpy(grads[-1].copy())
    for g in reversed(grads[:-1]):
        other += torch.from_numpy(g)
    assert dp == 2 or not np.array_equal(other.numpy(), ref.numpy())
    sent = [ts[k].sent_bytes() for k in keys]
    for r, s in enumerate(sent):  # reduce-scatter + all-gather: 2 (dp - 1) / dp of the gradient
        lo, hi = chunk_bounds(grads[0].size, dp)[r]
        assert s["chunk"] == 4 * (grads[0].size - (hi - lo))
        assert s["gather"] == 4 * (dp - 1) * (hi - lo)
    assert sum(s["chunk"] + s["gather"] for s in sent) / dp <= 2.5 * grads[0].nbytes


def test_messages_arriving_before_they_are_asked_for_are_kept():
    a, b = ShardKey(0, 0), ShardKey(1, 0)
    ts = linked([a, b])
    try:
        for mb in range(3):
            ts[a].send(b, Msg.ACT, mb, 1, np.full((2, 3), mb, np.float32))
        assert ts[b].recv(a, Msg.ACT, 2, 1)[0, 0] == 2
        assert ts[b].recv(a, Msg.ACT, 0, 1)[0, 0] == 0
        assert ts[b].recv(a, Msg.ACT, 1, 1).shape == (2, 3)
    finally:
        close(ts)


def blocked_receive(receive):
    """Run ``receive`` in a thread; return the thread and the list of what it raises once the
    thread is blocked in the transport's ``select``: its innermost Python frame is
    :meth:`SocketTransport._wait_readable` at the ``select`` call, seen twice in a row (a look
    from outside, so the wake-up a test then causes is tested, not a receive started too late)."""
    caught: list[BaseException] = []

    def run():
        try:
            receive()
        except BaseException as e:  # noqa: BLE001 - the test asserts what it was
            caught.append(e)

    th = threading.Thread(target=run, name="blocked-receive", daemon=True)
    th.start()
    lines, first = inspect.getsourcelines(SocketTransport._wait_readable)
    select_line = first + next(i for i, line in enumerate(lines) if "select.select(" in line)
    code, seen = SocketTransport._wait_readable.__code__, None
    give_up = time.monotonic() + 30  # a hang guard, not a time bound: a blocked receive is seen within milliseconds
    while time.monotonic() < give_up:
        assert th.is_alive(), f"the receive ended before it blocked: {caught}"
        frame = sys._current_frames().get(th.ident)
        at_select = frame is not None and frame.f_code is code and frame.f_lineno == select_line
        if at_select and seen is frame:
            return th, caught
        seen = frame if at_select else None
        time.sleep(0.002)
    pytest.fail("the receive never blocked in select")


def test_a_peer_that_closes_its_links_wakes_a_blocked_receiver_naming_it():
    a, b, c = ShardKey(0, 0), ShardKey(1, 0), ShardKey(2, 0)
    ts = linked([a, b, c])
    try:
        th, caught = blocked_receive(lambda: ts[c].recv(b, Msg.ACT, 0, 2))
        ts[b].poison()  # b failed: it closes its links
        th.join(10)
        assert not th.is_alive(), "the receiver stayed blocked on a peer that closed its links"
        assert len(caught) == 1 and isinstance(caught[0], PeerLost) and caught[0].peer == b, caught
    finally:
        close(ts)


def test_abort_wakes_a_blocked_receive_and_only_for_its_generation():
    a, b = ShardKey(0, 0), ShardKey(1, 0)
    ts = linked([a, b], generation=5)
    try:
        ts[b].abort(4)  # a late abort of an older generation does not touch this one
        ts[a].send(b, Msg.GRAD, 0, 0, np.ones(4, np.float32))
        assert ts[b].recv(a, Msg.GRAD, 0, 0).sum() == 4
        th, caught = blocked_receive(lambda: ts[b].recv(a, Msg.GRAD, 1, 0))
        ts[b].abort(5)
        th.join(10)
        assert not th.is_alive(), "the abort did not wake the blocked receive"
        assert len(caught) == 1 and isinstance(caught[0], Aborted), caught
    finally:
        close(ts)


@pytest.mark.parametrize("swapped,redundant", [(False, False), (True, False), (False, True)])
def test_link_peers_are_symmetric_and_cover_every_message_of_a_step(swapped, redundant):
    n, dp = 4, 3
    rts = routes(n, 4, swapped)
    peers = link_peers(n, dp, rts, redundant)
    for k, ps in peers.items():
        assert k not in ps
        for p in ps:
            assert k in peers[p]
    for r in range(dp):
        for route in rts:
            for a, b in zip(route, route[1:]):
                assert ShardKey(b.stage, r) in peers[ShardKey(a.stage, r)]
        for s in range(n):
            assert {ShardKey(s, q) for q in range(dp) if q != r} <= peers[ShardKey(s, r)]
            if redundant:  # the copy of the successor gets the gradients the successor received
                assert ShardKey((s + 1) % n, r) in peers[ShardKey(s, r)]
    for r in range(dp):  # the barrier's tree: every stage with its replica's stage 0, those with the root
        assert {ShardKey(s, r) for s in range(1, n)} <= peers[ShardKey(0, r)]
        assert r == 0 or ShardKey(0, 0) in peers[ShardKey(0, r)]
    if not swapped and not redundant:
        assert ShardKey(3, 1) not in peers[ShardKey(1, 1)]  # no links a step does not use
        assert ShardKey(0, 0) not in peers[ShardKey(2, 1)]  # the root links no stage of another replica but its stage 0


def test_no_actor_holds_links_to_every_stage_of_every_replica():
    """At 64 stages x 16 replicas the root linked to 1,023 actors (a sender thread and a socket
    each). With the barrier's tree an actor links to its replica's stages, its stage's replicas
    and its route neighbours: O(stages + replicas)."""
    n, dp = 64, 16
    peers = link_peers(n, dp, routes(n, 4))
    most = max(len(ps) for ps in peers.values())
    assert most <= n + dp, most
    assert len(peers[ShardKey(0, 0)]) == (n - 1) + (dp - 1)


def test_an_aborted_step_stops_inside_a_stages_forward_or_backward_at_a_layer_boundary():
    """The driver's abort reaches a stage that is computing, not only one blocked on a peer: its
    forward stops before its first layer runs, and its backward before any layer's gradient is
    computed (the op is left, not finished); a new link generation runs again. An abort that
    comes once the layers ran stops before the LM head's product."""
    from elastic_llm.config import load_config
    from elastic_llm.pipeline.stage import StageWorker

    cfg = load_config("jobs/tiny.yaml", ["model.dim=64", "model.n_layers=4", "model.seq_len=16", "parallel.stages=2"])
    w = StageWorker(cfg, 1, 0)  # the last stage: layers 2 and 3, then the head
    ran = []
    for i, layer in enumerate(w.module.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    first = linked([ShardKey(1, 0), ShardKey(0, 0)], generation=3)
    again = linked([ShardKey(1, 0), ShardKey(0, 0)], generation=4)
    third = linked([ShardKey(1, 0), ShardKey(0, 0)], generation=5)
    w.links = first[ShardKey(1, 0)]
    try:
        x = np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)
        targets = np.zeros((2, 16), np.int64)
        w.set_microbatches((2,), 2)
        w.links.abort(3)
        with pytest.raises(Aborted):
            w.forward(0, x, targets)
        assert ran == []  # not one layer ran
        w.links = again[ShardKey(1, 0)]  # the links of the next generation (a reset): it runs again
        w.forward(0, x, targets)
        assert ran == [0, 1]
        w.links.abort(4)
        with pytest.raises(Aborted):
            w.backward(0)
        assert all(p.grad is None for p in w.module.parameters())  # no gradient was computed, the head's included
        heads = []
        w.module.head.register_forward_hook(lambda *_: heads.append(1))
        w.links = third[ShardKey(1, 0)]
        w.module.norm.register_forward_hook(lambda *_: w.links.abort(5))  # the abort comes between the layers and the head
        w.reset_step()
        with pytest.raises(Aborted):
            w.forward(0, x, targets)
        assert ran == [0, 1, 0, 1] and heads == []  # the layers ran again, the LM head did not
    finally:
        close(first)
        close(again)
        close(third)


def test_a_link_and_a_plan_of_an_older_generation_are_refused_recorded_and_leave_the_links_alone():
    """A zombie (its node cut off while the run went on at a new generation, then healed) dials
    in with its old generation, or its relay delivers an old step plan: both are refused, named
    once, and the current links still carry the step."""
    import socket

    from elastic_llm.pipeline.transport import HELLO

    a, b = ShardKey(0, 0), ShardKey(1, 0)
    ts = linked([a, b], generation=5)
    try:
        zombie = socket.create_connection(ts[b].address)
        zombie.sendall(HELLO.pack(4, 0, 0))  # stage 0 replica 0 of generation 4
        assert zombie.recv(1) == b""  # closed at once
        assert ts[b].stale(4, "a plan of step 9") and not ts[b].stale(5, "a plan of step 9")
        refused = ts[b].take_refused()
        assert refused == ("a link from stage 0 replica 0 of link generation 4 (links at 5)", "a plan of step 9 of link generation 4 (links at 5)")
        assert ts[b].take_refused() == ()
        ts[a].send(b, Msg.ACT, 0, 1, np.ones((2, 2), np.float32))
        assert ts[b].recv(a, Msg.ACT, 0, 1).sum() == 4  # the live link was not touched
        zombie.close()
    finally:
        close(ts)
