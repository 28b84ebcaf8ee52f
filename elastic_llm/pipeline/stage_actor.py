"""The stage actor's class as Ray knows it: a light front for the worker, importing torch only
in the process that runs the stage.

Owns: :class:`StageWorker` (the class every stage actor and warm standby is started from, so
Ray's process titles, dashboard and state API still say ``StageWorker``), its thread groups
(:data:`CONCURRENCY_GROUPS`) and the one ``ray.remote`` of it (:func:`remote_stage_class`).

Why a front: Ray loads an actor's class in every process that receives a handle to one of its
actors, to learn its methods. The snapshot managers receive the stage actors' handles in every
plan (they call the stages for their pieces, so that they own them). When the handle's class was
the worker itself (:class:`elastic_llm.pipeline.stage.StageWorker`), each manager imported torch
and the model code for that alone: 1.8 s of CPU per manager process, on the same cores as the
training (measured on the 2-core loopback cluster: a manager process took 2.9 s of CPU to its
first snapshot with torch, 0.8 s without). This module imports nothing heavy: the front's methods
are the worker's public methods by name (:data:`STAGE_METHODS`; ``tests/test_code_health.py``
checks the list against the worker), each handing the call to the worker the actor's own process
built in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_llm.remote import remote_of

# The stage actor's thread groups besides training: "snapshot" serves its node manager's requests
# for copies (two threads: a request made before a rollback that still waits cannot hold up the
# requests of the steps run again), "status" the dashboard's state() and "control" the driver's
# control calls, so none of them waits behind a step; "relay" (stage 0 of a replica) sends the
# step to its replica's stages and waits for their reports while its own step runs.
CONCURRENCY_GROUPS = {"snapshot": 2, "status": 1, "control": 1, "relay": 1}

# every public method of elastic_llm.pipeline.stage.StageWorker (a remote call on a stage actor)
STAGE_METHODS = (
    "abort_step", "adopt", "backward", "cancel_receive", "capture_state", "connect_links", "corrupt_own_copies", "eval_forward",
    "flat_grad", "forward", "grad_norm", "grads", "hold_mirror", "holds_own_copy", "info", "inject_error", "keepalive",
    "layer_params", "link_address", "load_checkpoint", "load_durable", "load_parts", "load_rebuilt", "load_shadow", "load_state",
    "mirror_params", "mirror_source", "parameters", "rebuild", "receive_state", "relay_rest", "relay_step", "relay_to",
    "reset_step", "restore_own_copy", "role", "run_step", "save_checkpoint", "send_state", "set_flat_grad", "set_microbatches",
    "set_width", "shadow_backward", "shadow_state", "snapshot_now", "snapshot_pieces", "state", "state_manifest", "step",
)


class StageWorker:
    """A stage actor: builds :class:`elastic_llm.pipeline.stage.StageWorker` with the arguments
    it was started with, and hands it every call (the methods of :data:`STAGE_METHODS`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from elastic_llm.pipeline.stage import StageWorker as Worker

        self.worker = Worker(*args, **kwargs)


def _handing(name: str) -> Callable[..., Any]:
    def call(self: StageWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


for _name in STAGE_METHODS:
    setattr(StageWorker, _name, _handing(_name))

def remote_stage_class() -> Any:
    """``ray.remote`` of :class:`StageWorker` with its thread groups (made once per process): what
    the stage actors and the warm standbys are started from (an adopted standby is a stage actor)."""
    return remote_of(StageWorker, concurrency_groups=CONCURRENCY_GROUPS)
