"""``recovery.policy: redundant``: Bamboo's redundant computation (NSDI'23).

Models: each stage also trains a copy of its successor (``recovery.mode: redundant``). A lost
stage's copy, held by its predecessor, is promoted, with no rollback and no state transfer.
Notices are unused (``elastic.drains: false``).

Leaves out:
- Bamboo's pipeline reconfiguration after its redundancy is used up.
- Running more than one pipeline. ``recovery.mode: redundant`` trains one pipeline
  (``parallel.dp: 1``). The simulation does not model the redundant copies, so this policy runs
  on Ray only (see ``bench anchors``).

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
