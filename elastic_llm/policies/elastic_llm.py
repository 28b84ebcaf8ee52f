"""``recovery.policy: elastic-llm`` (the default): this project's own recovery.

Models: everything :mod:`elastic_llm.recovery.policy` describes. A lost stage is repaired alone,
from the cheapest lossless copy: its node's snapshot manager, a data-parallel peer, or a parity
rebuild. A rollback to the newest durable checkpoint comes only when no in-memory copy survives.
A replica that cannot be placed is dropped, and a warm standby is adopted instead of a process
start. Preemption notices move stages off draining nodes before their deadline, and the width
grows back when room for a replica appears.

Leaves out: nothing. The run's config is used as it is written.

Parameters: the run's own config. The defaults are in :mod:`elastic_llm.config.schema`.
"""

from __future__ import annotations

from elastic_llm.policies.base import Policy

POLICY = Policy("elastic-llm", "elastic-llm: per-stage repair from snapshots, parity and peers, notices acted on")
