"""The progress bar: a tqdm bar on a terminal; plain, periodic lines anywhere else (Ray job logs);
no total and no ETA for an open-ended run. Pure: fake clock, in-memory streams."""

import io

from elastic_llm.controller.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def record(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 2000.0, "dp": 1}


def run(bar: ProgressBar, clock: Clock, steps: int, total: int | None) -> None:
    bar.open(total, 0)
    for step in range(1, steps + 1):
        clock.t += 1.0  # a step a second
        bar.step(record(step), "running")
    bar.state("finished", steps, 1)
    bar.close()


def test_without_a_terminal_a_plain_line_at_most_every_ten_seconds_and_the_last_step():
    out, clock = io.StringIO(), Clock()
    run(ProgressBar(True, "tiny", stream=out, every_s=10.0, clock=clock), clock, 25, 100)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(",")[0] for line in lines] == ["tiny: step 1/100", "tiny: step 11/100", "tiny: step 21/100", "tiny: step 25/100"]
    assert lines[0] == "tiny: step 1/100, loss=4.900, tok/s=2000, dp=1, state=running"


def test_an_open_ended_run_shows_no_total_and_no_eta():
    out, clock = io.StringIO(), Clock()
    run(ProgressBar(True, "replay", stream=out, clock=clock), clock, 3, None)
    assert out.getvalue().splitlines() == ["replay: step 1, loss=4.900, tok/s=2000, dp=1, state=running", "replay: step 3, loss=4.700, tok/s=2000, dp=1, state=running"]
    tty, clock = Terminal(), Clock()
    run(ProgressBar(True, "replay", stream=tty, clock=clock), clock, 3, None)
    drawn = tty.getvalue().split("\r")
    assert "replay: 3step [00:00, " in drawn[-1] and all("<" not in bar and "/" not in bar.split("[")[0] for bar in drawn)  # no ETA, no total


def test_on_a_terminal_the_bar_has_its_total_and_eta():
    tty, clock = Terminal(), Clock()
    run(ProgressBar(True, "tiny", stream=tty, clock=clock), clock, 3, 10)
    assert "tiny:  30%|" in tty.getvalue() and "3/10 [" in tty.getvalue() and "<" in tty.getvalue()


def test_disabled_writes_nothing():
    out, clock = io.StringIO(), Clock()
    run(ProgressBar(False, "tiny", stream=out, clock=clock), clock, 3, 10)
    assert out.getvalue() == ""
