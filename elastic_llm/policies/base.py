"""What a named recovery policy is: :class:`Policy`, the settings it fixes in a run's config and
the three behaviours the one controller switches on for it. Pure: imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

DP = "parallel.dp"  # a setting whose value is this word takes the run's parallel.dp (a fixed width)


@dataclass(frozen=True)
class Policy:
    """One named recovery policy."""

    name: str
    models: str  # one line: the system whose recovery behaviour it is
    settings: tuple[tuple[str, object], ...] = ()  # ("section.field", value) the policy fixes; DP: the run's parallel.dp
    restart_all: bool = False  # a recovery ends every stage process and starts them all from the newest durable checkpoint (else the initial state)
    whole_replicas: bool = False  # a lost stage takes its whole data-parallel replica out; it rejoins by a peer copy when a whole replica fits
    restart_on_resize: bool = False  # a grow is followed by a restart of every process from the newest durable checkpoint

    def __str__(self) -> str:
        return f"{self.name} ({self.models})"
