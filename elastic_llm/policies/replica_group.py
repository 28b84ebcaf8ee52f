"""``recovery.policy: replica-group``: torchft's fault tolerance, where the data-parallel replica
group is the unit of failure.

Models:
- A lost stage takes its whole replica out: the replica's other stages stop, and the live
  replicas train on without it, at a smaller width and with no rollback. torchft's quorum
  leaves out the group whose member failed.
- The replica comes back once a whole replica's stages fit on free nodes. New processes start
  in the background and copy their state from a live replica (torchft's "heal" from a peer),
  then join at a step boundary. The look for room happens at every step, as torchft's quorum
  does (``elastic.grow_check_s: 1``).
- When no whole replica is left, every process starts again from the newest durable checkpoint.
  torchft needs a checkpoint for that case too.
- No in-memory snapshot of a stage is ever used for recovery, and notices are unused
  (``elastic.drains: false``).

Leaves out:
- The lighthouse and the quorum's own round trips. The run's step boundary stands in for them.
- Per-step gradient skipping when a replica fails mid-step. Here the failed step is replayed.
- torchft's ``min_replica_size``. ``elastic.min_replicas`` plays that part.

Parameters and their sources:
- Heal: a copy of one replica's state over the network (``network_mb_s`` of the cost model:
  25 GB/s on ``gpu-a100``). torchft#329 reports 948 s on TCP for Llama-3 8B, and about 20 s
  once state moved over InfiniBand; the model is the fast case.
- Rejoin: a process start (``actor_start_s``), in the background while the others train.
- Checkpoint interval: the run's ``durable.every``, as for :mod:`~elastic_llm.policies.restart`.
- Warm standbys: none (``recovery.standby: 0``).
"""

from __future__ import annotations

from elastic_llm.policies.base import Policy

QUORUM_S = 1.0  # torchft forms a quorum at every step: the look for room runs at (about) every step boundary

POLICY = Policy(
    "replica-group",
    "a lost stage drops its whole replica, which rejoins by a peer copy once a whole replica fits; no snapshots used (torchft)",
    settings=(
        ("elastic.grow_check_s", QUORUM_S),
        ("elastic.drains", False),
        ("recovery.standby", 0),
    ),
    whole_replicas=True,
)
