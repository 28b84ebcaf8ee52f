"""``recovery.policy: redundant``: Bamboo's redundant computation (NSDI'23).

Models: each stage also trains a copy of its successor (``recovery.mode: redundant``). A lost
stage's copy, held by its predecessor, is promoted, with no rollback. With several pipelines,
the copies' gradients are summed over the replicas with their stages', and a stage lost with
its holder or successor copies a live replica's stage (and its copy). Notices are unused
(``elastic.drains: false``).

Leaves out:
- Bamboo's pipeline reconfiguration after its redundancy is used up; here a live replica's
  stage stands in, and with none the run stops.
- Bamboo's placement of a copy on another node than its stage's successor, and its lazy
  backward of the copies (computed here at every step: about 1.75x a step on this project's
  runs).
- The simulation: it does not model the copies yet, so this policy runs on Ray only (see
  ``bench anchors``).

Parameters and their sources:
- The copy's cost: the successor's forward and backward on every stage, measured by this
  project's runs (the published figure is in Bamboo's paper, section 6).
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
