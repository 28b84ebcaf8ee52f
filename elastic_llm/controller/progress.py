"""The live progress of a run on stderr: step, loss, tokens/s, validation loss, data-parallel
width, state.

Owns how progress is shown: a tqdm bar when the stream is a terminal; otherwise (Ray job logs, a
pipe, a file) tqdm turns itself off (``disable=None``, its own check for a terminal; tqdm has no
plain-line mode, and its ``mininterval`` does not hold back the explicit refreshes a bar set by
hand needs) and a plain line is written instead, for the first step, then at most every
``every_s`` seconds, and for the last step when the run ends. An open-ended run (``total`` None:
a replay trains until it is stopped) shows no total and no ETA.
Never decides anything and never reads the run itself: the trainer tells it what happened.
Disabled, every method does nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

LINE_EVERY_S = 10.0  # without a terminal: at most one progress line per this many seconds


def postfix(record: dict[str, Any], state: str) -> dict[str, Any]:
    """What is shown after the step count: loss, tokens/s, width, state, and what the step has
    of validation loss and automatic cadences."""
    post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}", "dp": record.get("dp", 1), "state": state}
    if "val_loss" in record:
        post["val"] = f"{record['val_loss']:.3f}"
    if "snapshot_every" in record:  # snapshot.every: auto
        post["snap/"] = record["snapshot_every"]
    if "durable_every" in record:
        post["durable/"] = record["durable_every"]
    return post


class ProgressBar:
    def __init__(self, enabled: bool, desc: str, stream: IO[str] | None = None, every_s: float = LINE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.desc = desc
        self.stream = stream  # None: sys.stderr as it is when the bar opens
        self.every_s = every_s
        self.clock = clock
        self.bar: Any = None
        self.total: int | None = None
        self.pending: str | None = None  # without a terminal: the newest line, not written yet
        self.written_at = float("-inf")

    def open(self, total: int | None, initial: int) -> None:
        """``total`` None: an open-ended run (no total, no ETA)."""
        if self.enabled and self.bar is None:
            from tqdm import tqdm

            self.total = total
            self.bar = tqdm(total=total, initial=initial, unit="step", desc=self.desc, dynamic_ncols=True, file=self.stream or sys.stderr, disable=None)

    @property
    def plain(self) -> bool:
        """Whether progress goes out as plain lines (the stream is not a terminal)."""
        return self.bar is not None and self.bar.disable

    def step(self, record: dict[str, Any], state: str) -> None:
        if self.bar is None:
            return
        post = postfix(record, state)
        if self.plain:
            self._line(record["step"], post)
            return
        self.bar.set_postfix(post, refresh=False)
        self.bar.n = record["step"]
        self.bar.refresh()

    def state(self, state: str, step: int, width: int) -> None:
        """A change of state (the trainer logs it on its own line; a plain line waits for the next step)."""
        if self.bar is not None and not self.plain:
            self.bar.n = step
            self.bar.set_postfix({"dp": width, "state": state})

    def close(self) -> None:
        if self.bar is not None:
            if self.pending is not None:
                self._write()
            self.bar.close()
            self.bar = None

    def _line(self, step: int, post: dict[str, Any]) -> None:
        count = f"{step}/{self.total}" if self.total is not None else str(step)
        self.pending = f"{self.desc}: step {count}, " + ", ".join(f"{k}={v}" for k, v in post.items())
        if self.clock() - self.written_at >= self.every_s:
            self._write()

    def _write(self) -> None:
        print(self.pending, file=self.stream or sys.stderr, flush=True)
        self.pending = None
        self.written_at = self.clock()
