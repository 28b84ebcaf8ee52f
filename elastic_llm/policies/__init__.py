"""The named recovery policies a run follows (``recovery.policy``): elastic-llm's own and the
anchors it is compared with, each a setting of the one controller, never a second controller.

Owns :class:`Policy` (what a policy fixes in the run's config, and the three behaviours the
controller switches on for it), the registry :data:`POLICIES` and :func:`named`. The config
loader puts a policy's settings into a run's config (:mod:`elastic_llm.config.loading`). Each
anchor lives in a module of its own whose opening says what it models, what it leaves out, and
the source of each of its parameters. Pure: no Ray, no clock, no I/O.
"""

from __future__ import annotations

from elastic_llm.policies import elastic_llm, ray_train_elastic, redundant, replica_group, restart
from elastic_llm.policies.base import DP, Policy

__all__ = ["DEFAULT", "DP", "POLICIES", "Policy", "named", "names"]

POLICIES: dict[str, Policy] = {p.name: p for p in (elastic_llm.POLICY, restart.POLICY, ray_train_elastic.POLICY, replica_group.POLICY, redundant.POLICY)}
DEFAULT = "elastic-llm"


def names() -> tuple[str, ...]:
    return tuple(POLICIES)


def named(name: str) -> Policy:
    """The policy called ``name``; :class:`KeyError` naming the known ones if there is none."""
    known = names()
    if name not in POLICIES:
        raise KeyError(f"recovery.policy={name!r} is unknown: use one of {', '.join(known)}")
    return POLICIES[name]
