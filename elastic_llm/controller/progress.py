"""The live progress bar of a run (tqdm on stderr): step, loss, tokens/s, validation loss,
data-parallel width, state.

Owns the bar only; never decides anything and never reads the run itself: the trainer tells it
what happened. Disabled, every method does nothing.
"""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    def __init__(self, enabled: bool, desc: str) -> None:
        self.enabled = enabled
        self.desc = desc
        self.bar: Any = None

    def open(self, total: int, initial: int) -> None:
        if self.enabled and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", desc=self.desc, dynamic_ncols=True, file=sys.stderr)

    def step(self, record: dict[str, Any], state: str) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}", "dp": record.get("dp", 1), "state": state}
        if "val_loss" in record:
            post["val"] = f"{record['val_loss']:.3f}"
        if "snapshot_every" in record:  # snapshot.every: auto
            post["snap/"] = record["snapshot_every"]
        if "durable_every" in record:
            post["durable/"] = record["durable_every"]
        self.bar.set_postfix(post, refresh=False)
        self.bar.n = record["step"]
        self.bar.refresh()

    def state(self, state: str, step: int, width: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({"dp": width, "state": state})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
