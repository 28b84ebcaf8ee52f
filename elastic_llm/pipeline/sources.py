"""The sources of a stage's state other than its own snapshots' pieces: a shard rebuilt from
parity, a live peer, its neighbours, a redundant copy, checkpoint files and durable checkpoints.

Owns: what a stage actor does for the recovery modes that do not restore its own snapshot (mixed
into :class:`~elastic_llm.pipeline.stage.StageWorker`, whose actor methods these are): the shards
of its committed snapshot whose nodes are lost, rebuilt by the stage itself from their erasure
groups' survivors and decoded straight into its own state (a new stage's), a live actor's whole
state streamed over one socket (a data-parallel peer's, for a lost replica or a new one; its
own, for a stage that moves), CheckFree / CheckFree+ (its layers for a neighbour to average, the
mirror of its neighbour's embedding or LM head it keeps, rebuilding itself from neighbours' layers
with a fresh optimizer and a resumed LR schedule), the redundant copy of its successor
(``recovery.mode: redundant``), checkpoint files (``recovery.mode: checkpoint``) and a durable
checkpoint of any width or stage count. Never decides which source serves a stage (the recovery plan does).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from elastic_llm.pipeline.optim import StageAdamW, StageSchedule
from elastic_llm.snapshot.records import ParityRebuild, ShardKey
from elastic_llm.tensors import host, host_bytes


class OtherSources:
    """Mixed into the stage actor: needs its ``module``, ``optimizer``, ``scheduler``, ``copies``,
    ``arena``, ``shadow``, ``cfg``, ``stage``, ``replica``, ``step_count``, ``mirror`` and its
    ``capture_state``, ``load_state``, ``load_parts`` and ``reset_step``."""

    module: Any
    optimizer: StageAdamW
    scheduler: StageSchedule
    copies: Any
    arena: Any
    shadow: Any
    cfg: Any
    stage: int
    replica: int
    step_count: int
    mirror: np.ndarray | None
    mirror_step: int
    links: Any

    def link_address(self) -> tuple[str, int]:
        raise NotImplementedError  # the stage's

    def state_manifest(self, lo: int, hi: int, data_position: Any = None) -> str:
        raise NotImplementedError  # the stage's

    def capture_state(self, data_position: Any = None, replica_slice: bool = False) -> tuple[np.ndarray, str]:
        raise NotImplementedError  # the stage's

    def load_state(self, buffer: np.ndarray, manifest: str) -> int:
        raise NotImplementedError  # the stage's

    def load_parts(self, manifest: str, offsets: list[int], *parts: np.ndarray) -> int:
        raise NotImplementedError  # the stage's

    def reset_step(self) -> int:
        raise NotImplementedError  # the stage's

    # ------------------------------------------------------------------ shards rebuilt from parity
    def load_rebuilt(self, manifest: str, offsets: list[int], rebuilds: list[ParityRebuild], *parts: np.ndarray) -> tuple[int, int, float]:
        """Restore from the managers' pieces (``parts[i]`` at ``offsets[i]``) and the shards
        ``rebuilds`` names, each rebuilt from its erasure group's survivors
        (:func:`~elastic_llm.snapshot.rebuild.rebuild_into`: the members' pieces pulled in
        parallel, decoded as they arrive). A new CPU stage (no step trained or restored: nothing to
        keep) decodes straight into its state, with no buffer and no copy after; if a rebuild
        fails midway its state is neither its initial one nor the snapshot's, so it says it has
        completed step -1 (any plan restores it again). A stage holding trained state decodes into
        a reused buffer first: a failed rebuild leaves it as it was. Returns (step, bytes rebuilt,
        seconds the rebuilds took)."""
        from elastic_llm.snapshot.erasure import ReedSolomon
        from elastic_llm.snapshot.rebuild import rebuild_into

        self.copies.wait()  # no background copy reads the state while it is written
        into = self.arena.host_view() if self.step_count == 0 else None
        buf = into if into is not None else self.copies.buffer(2)
        t0 = time.perf_counter()
        shards = [r.shard for r in rebuilds]
        views = [buf[s.lo : s.lo + s.nbytes] for s in shards]
        codecs: dict[tuple[int, int], ReedSolomon] = {}
        try:
            for r, view in zip(rebuilds, views):
                k = r.n - r.parity
                rs = codecs.setdefault((k, r.parity), ReedSolomon(k, r.parity, backend=self.cfg.snapshot.codec))
                rebuild_into(rs, r, view)
        except BaseException:
            if into is not None:
                self.step_count = -1
            raise
        seconds = time.perf_counter() - t0
        step = self.load_parts(manifest, [*offsets, *(s.lo for s in shards)], *parts, *views)
        return step, sum(s.nbytes for s in shards), seconds

    # ------------------------------------------------------------------ a live actor's state, over a socket
    def send_state(self, address: tuple[str, int]) -> int:
        """Stream this stage's whole state to the actor listening at ``address`` (its
        :meth:`receive_state`): a CPU stage sends its arena's own memory, nothing is copied.
        Returns the bytes sent."""
        from elastic_llm.pipeline.transport import send_state

        self.copies.wait()  # no background copy reads the arena while it is sent (nothing writes it: no step runs)
        view = self.arena.host_view()
        if view is None:  # a GPU stage: through its reused host buffer
            view, manifest = self.capture_state()
        else:
            manifest = self.state_manifest(0, self.arena.layout.nbytes)
        return send_state(address, ShardKey(self.stage, self.replica), manifest, view.data.cast("B"))

    def receive_state(self, peer: ShardKey) -> tuple[int, float]:
        """Take the whole state ``peer`` streams with :meth:`send_state`, read straight into the
        arena (a CPU stage; a GPU stage's reused host buffer), then restore its optimizer,
        schedule, RNG and step from the manifest. Until then the stage holds no step (-1): a copy
        that breaks midway leaves it for any plan to restore. Returns (bytes, seconds)."""
        from elastic_llm.snapshot.state import SnapshotFormatError

        self.link_address()  # the listener the sender connects to
        t0 = time.perf_counter()
        got: dict[str, np.ndarray] = {}

        def into(manifest: str, n: int) -> memoryview:
            if n != self.arena.layout.nbytes:
                raise SnapshotFormatError(f"stage {self.stage}: {peer} sent {n} bytes of state, this stage's state is {self.arena.layout.nbytes}: not the same stage")
            self.copies.wait()
            self.step_count = -1
            view = self.arena.host_view()
            got["view"] = view if view is not None else self.copies.buffer(2)[:n]
            return got["view"].data.cast("B")

        manifest = self.links.receive_state(peer, into)
        self.load_parts(manifest, [0], got["view"])
        return int(got["view"].nbytes), time.perf_counter() - t0

    def cancel_receive(self) -> None:
        """Called in the control group: end a :meth:`receive_state` whose sender failed before it connected."""
        if self.links is not None:
            self.links.cancel_receive()

    # ------------------------------------------------------------------ CheckFree / CheckFree+
    def _outer(self) -> list[torch.nn.Parameter]:
        """Parameters outside the transformer layers: the embedding, or final norm + LM head."""
        return [p for n, p in self.module.named_parameters() if not n.startswith("layers.")]

    def layer_params(self) -> np.ndarray:
        """The transformer layers' parameters, flat float32 in module order (what CheckFree
        averages: every stage has the same layers in the same layout)."""
        return host(torch.cat([p.detach().reshape(-1) for n, p in self.module.named_parameters() if n.startswith("layers.")]))

    def mirror_source(self) -> np.ndarray:
        """This stage's embedding (first stage) or final norm + LM head (last stage), flat."""
        return host(torch.cat([p.detach().reshape(-1) for p in self._outer()]))

    def hold_mirror(self, values: np.ndarray, step: int) -> int:
        """Keep the neighbour's embedding / head (its :meth:`mirror_source` after ``step``)."""
        self.mirror = np.array(values, copy=True)
        self.mirror_step = step
        return step

    def mirror_params(self) -> np.ndarray:
        if self.mirror is None:
            raise RuntimeError(f"stage {self.stage} holds no mirror yet")
        return self.mirror

    def rebuild(self, step: int, lr_scale: float, a: float, b: float, next_layers: np.ndarray, prev_layers: np.ndarray | None = None, mirror: np.ndarray | None = None) -> int:
        """Become a stage rebuilt from neighbours at ``step``: layers = the average
        ``(a next + b prev) / (a + b)`` (CheckFree), or a copy of ``next_layers`` when
        ``prev_layers`` is None (CheckFree+: the first / last stage copies its neighbour); the
        embedding / head from ``mirror`` (else they keep their fresh initialisation). The
        optimizer starts fresh with the learning rate x ``lr_scale``; the LR schedule resumes at
        ``step``. Returns the CRC-32 of the new parameters (the recovery record carries it)."""
        import zlib

        from elastic_llm.recovery.checkfree import average

        self.copies.wait()
        layers = np.asarray(next_layers) if prev_layers is None else average(np.asarray(next_layers), np.asarray(prev_layers), a, b)
        with torch.no_grad():
            self._load_flat([p for n, p in self.module.named_parameters() if n.startswith("layers.")], layers)
            if mirror is not None:
                self._load_flat(self._outer(), np.asarray(mirror))
            for st in self.optimizer.state.values():  # a fresh optimizer: moments and step counts zero (in the arena)
                for value in st.values():
                    if torch.is_tensor(value):
                        value.zero_()
        self.scheduler.resume(step, lr_scale)  # the (fresh) optimizer's LR schedule at ``step``, its peak LR x ``lr_scale``
        self.step_count = step
        self.reset_step()
        return zlib.crc32(host_bytes(torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])).data)

    @staticmethod
    def _load_flat(params: list[torch.nn.Parameter], flat: np.ndarray) -> None:
        total = sum(p.numel() for p in params)
        if flat.size != total:
            raise ValueError(f"{flat.size} values for {total} parameters: the neighbour's layout differs")
        offset = 0
        for p in params:
            p.copy_(torch.from_numpy(flat[offset : offset + p.numel()]).view_as(p))
            offset += p.numel()

    # ------------------------------------------------------------------ redundant copy (Bamboo-style)
    def shadow_state(self) -> tuple[np.ndarray, str]:
        """The redundant copy's whole state as (bytes, manifest): what promotes it."""
        assert self.shadow is not None, "no redundant copy: recovery.mode is not redundant"
        return self.shadow.capture(self.step_count, self.cfg.config_hash())

    def load_shadow(self, buffer: np.ndarray, manifest: str) -> int:
        """Restore the redundant copy from the successor's own state (after this actor was replaced)."""
        assert self.shadow is not None, "no redundant copy: recovery.mode is not redundant"
        return self.shadow.load(buffer, manifest, self.cfg.config_hash())

    # ------------------------------------------------------------------ checkpoint files
    def save_checkpoint(self, root: str, step: int) -> int:
        """Write this stage's whole state to checkpoint ``step`` under ``root``; returns bytes."""
        from elastic_llm.checkpoint import write_stage

        buf, manifest = self.capture_state()
        return write_stage(root, step, self.stage, self.replica, buf, manifest)

    def load_checkpoint(self, root: str, step: int) -> int:
        """Restore this stage from checkpoint ``step`` under ``root`` (raw bytes and JSON only)."""
        from elastic_llm.checkpoint import read_stage

        data, manifest = read_stage(root, step, self.stage, self.replica)
        return self.load_state(data, manifest)

    def load_durable(self, run_uri: str, name: str) -> int:
        """Restore this stage from durable checkpoint ``name`` of the run at ``run_uri``: its
        layers' tensors by global name (any data-parallel width or stage count wrote them), every
        tensor checked against its CRC-32 as it is read. A new CPU stage (no step trained or
        restored: nothing to keep) reads straight into its state, with no buffer (a fresh one of
        the state's size can cost more to fault in than the whole read); if the checkpoint is
        refused midway its state is then neither its initial one nor the checkpoint's, so it says
        it has completed step -1 (any plan restores it again). A stage holding trained state
        reads into a buffer first: refused, nothing of it is loaded. Returns the step."""
        import json

        from elastic_llm.durable.format import Checkpoint
        from elastic_llm.durable.restore import stage_state
        from elastic_llm.durable.storage import Storage

        self.copies.wait()
        layout = self.arena.layout
        into = self.arena.host_view() if self.step_count == 0 else None
        buf = into if into is not None else self.copies.buffer(2)
        try:
            m = stage_state(Checkpoint(Storage(run_uri), name), layout.entries, layout.nbytes, self.module.layer_ids, self.stage, self.replica, self.cfg.config_hash(), buf)
        except BaseException:
            if into is not None:
                self.step_count = -1
            raise
        return self.load_parts(json.dumps(m), [0], buf)
