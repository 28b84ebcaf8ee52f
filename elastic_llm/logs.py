"""How elastic-llm's messages reach the user: the standard ``logging`` module, one logger per package.

Owns: :func:`configure`, which the command line calls once (``--log-level``): one handler on the
``elastic_llm`` logger, writing to stderr, one line per message as ``[tag] message`` with the tag
of the package that said it (``elastic-llm`` for the controller and the runtimes, ``simulate``,
``replay``, ``chaos`` for the soak, ``experiment``, ``spot-watcher``) and ``warning:`` /
``error:`` before the message at those levels. A program that uses elastic-llm as a library
configures logging itself, as it does for Ray and PyTorch (the loggers are
``elastic_llm.controller``, ``elastic_llm.runtime``, ``elastic_llm.snapshot``, ...). Never
prints on its own.
"""

from __future__ import annotations

import logging
import sys
from typing import IO

LEVELS = ("debug", "info", "warning", "error")
TAGS = {"elastic_llm.sim": "simulate", "elastic_llm.replay": "replay", "elastic_llm.soak": "chaos", "elastic_llm.experiment": "experiment",
        "elastic_llm.ops.spot_watcher": "spot-watcher"}


class _Lines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        tag = next((t for name, t in TAGS.items() if record.name == name or record.name.startswith(name + ".")), "elastic-llm")
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        text = f"[{tag}] {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a line is written (a test's capture, a redirect)."""

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass


def configure(level: str = "info", stream: IO[str] | None = None) -> None:
    """Send the ``elastic_llm`` loggers' messages at ``level`` and above to ``stream`` (default:
    the process's stderr at the time of each line)."""
    root = logging.getLogger("elastic_llm")
    for h in list(root.handlers):
        if getattr(h, "elastic_llm", False):
            root.removeHandler(h)
    handler: logging.Handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler.setFormatter(_Lines())
    handler.elastic_llm = True  # type: ignore[attr-defined]  # ours: replaced, not stacked, by a second call
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    root.propagate = False
