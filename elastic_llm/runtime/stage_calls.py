"""The calls that move a stage's state on Ray: actor to actor, store to actor, neighbours to actor.

Owns: the :class:`~elastic_llm.controller.ports.StageActors` primitives that carry state, as
object refs only (the bytes go actor to actor or store to actor; the driver fetches at most a
gradient norm): copying a live actor's whole state into another (a data-parallel peer, a grow, a
drain move: streamed over a socket, :func:`stream_states`), loading a snapshot's pieces, restoring an actor's own background copy, loading a
durable checkpoint (a refused file comes back as its :class:`DurableError`, without Ray's
wrapping), CheckFree's rebuild from the neighbours' layers, promoting a redundant copy, the
CheckFree+ mirrors, and the checkpointing baseline's files. Each waits with a deadline.
Never decides which source serves which actor (the recovery plan does).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from elastic_llm.config import RunConfig
from elastic_llm.durable.format import DurableError
from elastic_llm.runtime.handover import CONTROL
from elastic_llm.snapshot.records import Piece, ShardKey, StageSource
from elastic_llm.spans import Spans

COPY_S = 600.0  # longest a state copy from one actor to another may take
RESTORE_S = 600.0  # longest a restore (copying state into the stages) may take
OWN_COPY_S = 10.0  # longest the survivors get to say whether their own copy holds the committed version


def checkpoint_refusal(error: BaseException) -> DurableError | None:
    """The :class:`DurableError` a stage actor raised loading a durable checkpoint (the checkpoint
    is at fault: a corrupted, truncated or foreign file), with its message only, without Ray's
    wrapping and the actor's traceback; None for any other error."""
    cause = getattr(error, "cause", None)
    return DurableError(str(cause)) if isinstance(cause, DurableError) else None


def stream_states(copies: list[tuple[Any, ShardKey, Any]], shadows: bool = False) -> list[tuple[int, float]]:
    """For each (source actor, its key, target actor): the source streams its whole state to the
    target over one TCP connection, from its memory into the target's (``send_state`` /
    ``receive_state``: not through the object store), all copies at once. Returns per copy the
    bytes and the target's seconds. A source that fails before it connected has its target's
    wait cancelled (the target's control group), so the target is not left waiting; the first
    failure raises. With ``shadows`` (``recovery.mode: redundant``), each target then also takes
    its source's redundant copy (of the same successor stage, at the same step)."""
    import ray

    if not copies:
        return []
    addresses = ray.get([dst.link_address.remote() for _, _, dst in copies], timeout=COPY_S)
    receives = [dst.receive_state.remote(key) for _, key, dst in copies]
    sends = {src.send_state.remote(addr): dst for (src, _, dst), addr in zip(copies, addresses)}
    deadline = time.monotonic() + COPY_S
    waiting = [*receives, *sends]
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(f"{len(waiting)} state copies did not end within {COPY_S:.0f} s")
        try:
            ray.get(done[0], timeout=0)
        except ray.exceptions.RayError:
            if done[0] in sends:
                sends[done[0]].cancel_receive.options(concurrency_group=CONTROL).remote()
            raise
    if shadows:
        taken = [(dst, src.shadow_state.options(num_returns=2).remote()) for src, _, dst in copies]
        ray.get([dst.load_shadow.remote(*refs) for dst, refs in taken], timeout=max(0.0, deadline - time.monotonic()))
    return [tuple(x) for x in ray.get(receives, timeout=0)]


class StateCalls:
    """Mixed into the Ray actor group: needs ``actor(key)``, ``keys()``, ``cfg``, ``spans``, ``stages`` and ``width``."""

    cfg: RunConfig
    spans: Spans
    stages: int

    @property
    def width(self) -> int:
        raise NotImplementedError  # the group's

    def actor(self, key: ShardKey) -> Any:
        raise NotImplementedError  # the group's

    def keys(self) -> list[ShardKey]:
        raise NotImplementedError  # the group's

    def copy_stages(self, pairs: list[tuple[ShardKey, ShardKey]]) -> dict[ShardKey, tuple[int, float]]:
        """For each (source, target): the target actor takes the whole state of the source
        (:func:`stream_states`). Returns per target its bytes and seconds."""
        with self.spans.span("state"):
            got = stream_states([(self.actor(src), src, self.actor(dst)) for src, dst in pairs], self.cfg.redundant)
        return {dst: g for (_, dst), g in zip(pairs, got)}

    def load_parts(self, sources: Mapping[ShardKey, StageSource]) -> dict[ShardKey, tuple[int, float]]:
        """Each actor loads the pieces of its committed state (straight from the managers'
        stores); one with shards to rebuild from parity decodes them into its own state first.
        Returns, per actor that rebuilt, the bytes rebuilt and the seconds the rebuilds took."""
        import ray

        calls = {
            k: self.actor(k).load_rebuilt.remote(src.manifest, list(src.offsets), list(src.rebuilds), *src.refs)
            if src.rebuilds else self.actor(k).load_parts.remote(src.manifest, list(src.offsets), *src.refs)
            for k, src in sources.items()
        }
        got = ray.get(list(calls.values()), timeout=RESTORE_S)
        return {k: (int(g[1]), float(g[2])) for k, g in zip(calls, got) if sources[k].rebuilds}

    def holds_own_copy(self, keys: list[ShardKey], version: int) -> set[ShardKey]:
        """Those of ``keys`` whose own background copy holds version ``version`` (one deadline;
        an actor that died meanwhile is left out: the next observation sees it lost)."""
        import ray

        asks = {self.actor(k).holds_own_copy.remote(version): k for k in keys}
        ready, _ = ray.wait(list(asks), num_returns=len(asks), timeout=OWN_COPY_S)
        held = set()
        for ref in ready:
            try:
                if ray.get(ref, timeout=0):
                    held.add(asks[ref])
            except ray.exceptions.RayActorError:
                continue
        return held

    def restore_own_copies(self, keys: list[ShardKey], version: int, pieces: Mapping[ShardKey, tuple[Piece, ...]]) -> list[ShardKey]:
        """Each of ``keys`` restores its own copy of ``version`` (checked against ``pieces``'
        checksums); returns those whose copy failed."""
        import ray

        calls = [self.actor(k).restore_own_copy.remote(version, pieces[k]) for k in keys]
        return [k for k, ok in zip(keys, ray.get(calls, timeout=RESTORE_S)) if not ok]

    def load_durable(self, keys: list[ShardKey], uri: str, name: str) -> None:
        """Each of ``keys`` reads its part of durable checkpoint ``name`` of run ``uri``."""
        import ray

        calls = [self.actor(k).load_durable.remote(uri, name) for k in keys]
        try:
            ray.get(calls, timeout=RESTORE_S)
        except ray.exceptions.RayTaskError as e:
            refusal = checkpoint_refusal(e)
            if refusal is None:
                raise
            raise refusal from None

    def grad_norms(self, keys: list[ShardKey]) -> dict[ShardKey, float]:
        import ray

        return dict(zip(keys, ray.get([self.actor(k).grad_norm.remote() for k in keys], timeout=COPY_S)))

    def rebuild(self, key: ShardKey, step: int, lr_scale: float, a: float, b: float, donors: tuple[ShardKey, ...], mirror: ShardKey | None) -> int:
        """CheckFree: the (new) actor of ``key`` becomes ``a`` x the first donor's layers + ``b`` x
        the second's (CheckFree+: a copy of the one donor, the embedding / head from ``mirror``).
        Returns the CRC-32 of its parameters."""
        import ray

        layers = [self.actor(d).layer_params.remote() for d in donors]
        mirrored = self.actor(mirror).mirror_params.remote() if mirror is not None else None
        nxt, prev = (layers + [None])[:2]
        return int(ray.get(self.actor(key).rebuild.remote(step, lr_scale, a, b, nxt, prev, mirrored), timeout=COPY_S))

    def promote(self, key: ShardKey, holder: ShardKey, successor: ShardKey) -> None:
        """The new actor of ``key`` takes its state from the redundant copy ``holder`` trains, and
        its own copy of its successor from ``successor``'s state."""
        import ray

        buf, manifest = self.actor(holder).shadow_state.options(num_returns=2).remote()
        sbuf, smanifest = self.actor(successor).capture_state.options(num_returns=2).remote()
        ray.get([self.actor(key).load_state.remote(buf, manifest), self.actor(key).load_shadow.remote(sbuf, smanifest)], timeout=COPY_S)

    def mirror(self, pairs: list[tuple[ShardKey, ShardKey]], step: int) -> None:
        """CheckFree+: each (source, holder) pair copies the source's embedding or head onto the
        holder. Not waited for: actor call order puts them before the next step's."""
        for src, dst in pairs:
            self.actor(dst).hold_mirror.remote(self.actor(src).mirror_source.remote(), step)

    def save_checkpoints(self, root: str, step: int) -> int:
        import ray

        return int(sum(ray.get([self.actor(k).save_checkpoint.remote(root, step) for k in self.keys()], timeout=COPY_S)))

    def load_checkpoints(self, root: str, step: int) -> None:
        import ray

        ray.get([self.actor(k).load_checkpoint.remote(root, step) for k in self.keys()], timeout=COPY_S)
