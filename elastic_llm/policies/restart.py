"""``recovery.policy: restart``: a fixed-width job that restarts from its checkpoint (DeepSpeed or
Megatron-LM under ``torchrun``, or any job a scheduler requeues after a failure).

Models: the width is fixed (``elastic.min_replicas = elastic.max_replicas = parallel.dp``).
Any failure ends every stage process. All of them start again and load the newest durable
checkpoint; training since that checkpoint is lost. While fewer nodes are alive than the full
width needs, the job waits for them. ``torchrun --nnodes=N`` waits the same way for N agents
in rendezvous.

Leaves out:
- The time a scheduler takes to requeue the job. The waiting time is counted; a queue is not.
- ``torchrun``'s rendezvous timeout (``join_timeout``, 600 s by default), after which the job
  would fail. Here it waits as long as the trace needs (``recovery.capacity_timeout_s``).
- Preemption notices. These jobs do not act on them (``elastic.drains: false``).

Parameters and their sources:
- Checkpoint interval: the run's ``durable.every``. `bench anchors` gives every policy the same
  one: every committed snapshot, one flush at a time. This is the best a baseline gets from
  ``torch.distributed.checkpoint.async_save``, where a checkpoint is staged to host memory and
  written in the background.
- Restart cost: a process start for every stage (``actor_start_s`` of the cost model: 20 s on
  ``gpu-a100``, the order Oobleck and Bamboo report for restarting a pipeline stage) and a
  read of the checkpoint at the durable tier's rate (``flush_mb_s``).
- Warm standbys: none (``recovery.standby: 0``). A restart starts new processes.
"""

from __future__ import annotations

from elastic_llm.policies.base import DP, Policy

WAIT_S = 1e7  # seconds a restart waits for full width: longer than any trace

POLICY = Policy(
    "restart",
    "fixed width, restart every process from the latest durable checkpoint, wait for full width (torchrun + DeepSpeed/Megatron)",
    settings=(
        ("elastic.min_replicas", DP),
        ("elastic.max_replicas", DP),
        ("elastic.drains", False),
        ("recovery.standby", 0),
        ("recovery.capacity_timeout_s", WAIT_S),
    ),
    restart_all=True,
)
