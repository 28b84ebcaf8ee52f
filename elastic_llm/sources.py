"""Where a recovered stage's state comes from, where a rollback's comes from, the recovery modes,
and the ways a source or a placement can fail: the words the recovery policy, the snapshot layer and the controller share.

Owns :class:`Source` (what the policy writes into each action of a plan, the executor follows and
the metrics line reports), :class:`Mode` (``recovery.mode``), :class:`RollbackFrom`, and the errors :class:`UnrecoverableError` (no
lossless source survives), :class:`SourceLost` (a source the plan named was gone when the
plan was carried out) and :class:`NodeGone` (a node the plan placed something on is gone). Their values are the words the metrics file, logs and reports have always
used, so a value written out reads back the same. It sits below both ``snapshot`` and
``recovery`` (each imports it, neither imports the other for it). Pure: imports nothing of the
project.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: a str enum that formats as its value, as 3.11's StrEnum does
    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class Source(StrEnum):
    """Where a lost stage's state comes from."""

    LOCAL_SMP = "local_smp"  # its node's snapshot manager (the stage process died, its node lives)
    DP_PEER = "dp_peer"  # a data-parallel peer holding the same state
    PARITY = "parity"  # rebuilt from its erasure group's parity
    CHECKFREE = "checkfree"  # averaged from its two neighbours (lossy)
    CHECKFREE_PLUS = "checkfree_plus"  # copied from one neighbour (+ the mirrored embedding or head; lossy)
    REDUNDANT = "redundant"  # its copy held by the predecessor stage, promoted
    CHECKPOINT = "checkpoint"  # the checkpointing baseline's newest checkpoint
    DURABLE = "durable"  # the run's newest durable checkpoint
    INITIAL = "initial"  # the run's initial state (step 0, the seed's weights): a new process builds it

    @property
    def lossless(self) -> bool:
        return self not in LOSSY


LOSSY = (Source.CHECKFREE, Source.CHECKFREE_PLUS)  # a tuple: `in` compares by value, so a plain "checkfree" is found too


class Mode(StrEnum):
    """``recovery.mode``: how a run recovers (the config keeps the word; the policy and the
    executors compare against these)."""

    LOSSLESS = "lossless"  # snapshots (and the ladder below them); the only mode that takes snapshots
    CHECKFREE = "checkfree"  # no copies: a lost stage is rebuilt from its neighbours
    CHECKFREE_PLUS = "checkfree_plus"  # CheckFree plus mirrors of the embedding and head, for the first and last stage
    CHECKPOINT = "checkpoint"  # the checkpointing baseline
    REDUNDANT = "redundant"  # Bamboo-style redundant computation: each stage trains a copy of its successor


class RollbackFrom(StrEnum):
    """Where everyone's state of a rollback comes from."""

    SNAPSHOT = "snapshot"  # the committed in-memory snapshot version
    CHECKPOINT = "checkpoint"
    DURABLE = "durable"
    INITIAL = "initial"  # step 0: every actor a new process (or a warm standby adopted), as the run began


class UnrecoverableError(RuntimeError):
    """No lossless source survives; the message says what was lost and how to avoid it."""


class SourceLost(RuntimeError):
    """A source the plan named turned out to be gone while the plan was carried out (a shard
    failed to load where the plan expected it): the controller observes again, which now sees it
    gone, and re-plans."""


class NodeGone(RuntimeError):
    """Nodes that something was being placed on (a stage, a spare, a standby, a snapshot manager,
    a parity piece's home) turned out to be gone: Ray's scheduler refused to place there (the
    refusal is the declaration of the node's death), or the node died while the plan was being
    carried out. Not a failure of the run: the controller declares the nodes lost and plans again
    without them, charging nothing (each node once: a node that keeps coming back is a loop)."""

    def __init__(self, nodes: frozenset[str], why: str) -> None:
        self.nodes, self.why = frozenset(nodes), why
        super().__init__(f"node(s) {', '.join(sorted(n[:12] for n in self.nodes)) or '?'} gone: {why}")
