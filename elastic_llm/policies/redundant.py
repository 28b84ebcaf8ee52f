"""``recovery.policy: redundant``: Bamboo's redundant computation (NSDI'23).

Models: each stage also trains a copy of its successor (``recovery.mode: redundant``). A lost
stage's copy, held by its predecessor, is promoted, with no rollback. With several pipelines,
the copies' gradients are summed over the replicas with their stages', and a stage lost with
its holder or successor copies a live replica's stage (and its copy). Notices are unused
(``elastic.drains: false``).

Leaves out:
- Bamboo's pipeline reconfiguration after its redundancy is used up; here a live replica's
  stage stands in, and with none the run stops.
- Bamboo's placement of a copy on another node than its stage's successor (here a stage and
  its successor often share a node, so a node loss takes both: a live replica's copy serves),
  and its lazy backward of the copies and forward in pipeline bubbles (computed here at every
  step).

Parameters and their sources:
- The copy's cost: the successor's forward and backward on every stage, and its gradients in
  the replicas' sum. On Ray it is the real compute; the simulation charges ``redundant_extra``
  of the cost model (0.79: bench convergence's redundant step on tiny, 1.79x the median of no
  fault tolerance) on top of a step's compute and exchange.
- A promotion: the new actor reads two stage states over its link (the holder's copy, and its
  successor's state for its own copy); a copy from a live replica reads the same two.
- Warm standbys: none (``recovery.standby: 0``).
"""

from __future__ import annotations

from elastic_llm.policies.base import Policy

POLICY = Policy(
    "redundant",
    "each stage trains a copy of its successor, promoted when the successor is lost (Bamboo)",
    settings=(
        ("recovery.mode", "redundant"),
        ("elastic.drains", False),
        ("recovery.standby", 0),
    ),
)
