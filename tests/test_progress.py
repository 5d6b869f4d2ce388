"""The one progress display (``kvgate.progress``): a bar on a terminal, plain lines elsewhere
(throttled, the last step always), nothing when quiet."""

from __future__ import annotations

import io

from progress_fakes import Terminal

from kvgate.progress import Progress, duration, silenced


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_gets_one_bar_with_done_total_and_time_left():
    out = Terminal()
    with Progress(4, "labels", "block", stream=out) as bar:
        for _ in range(4):
            bar.advance(note="shard 1")
    text = out.getvalue()
    assert "\r" in text and "labels" in text and "4/4" in text
    assert "<" in text  # tqdm's [elapsed<left]
    assert "shard 1" in text
    assert "\n" not in text.rstrip("\n")  # one bar redrawn in place, not lines


def test_a_pipe_gets_a_line_per_step_with_elapsed_and_time_left():
    out, clock = io.StringIO(), Clock()
    bar = Progress(5, "labels", "block", stream=out, clock=clock, every=5.0)
    for _ in range(4):
        clock.now += 10.0  # slow steps: every one prints
        bar.advance(2 if bar.done == 0 else 1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "labels: 2/5 blocks (40%), 10s elapsed, ~15s left"
    assert len(lines) == 4  # close repeats no line
    assert lines[-1] == "labels: 5/5 blocks (100%), 40s elapsed, done"


def test_fast_steps_are_throttled_and_the_last_always_prints():
    out, clock = io.StringIO(), Clock()
    with Progress(100, "eval", "example", stream=out, clock=clock, every=5.0) as bar:
        for _ in range(100):
            clock.now += 0.5
            bar.advance(note="mc/copa")
    lines = out.getvalue().splitlines()
    # the first step, then one every 5 s (10 steps), and the last
    assert len(lines) == 11
    assert lines[0].startswith("eval: 1/100 examples (1%), 0s elapsed, ~50s left")
    assert lines[1].startswith("eval: 11/100 examples")
    assert lines[-1] == "eval: 100/100 examples (100%), 50s elapsed, done; mc/copa"


def test_a_line_held_back_is_printed_at_close():
    out, clock = io.StringIO(), Clock()
    bar = Progress(10, "eval", "example", stream=out, clock=clock)
    clock.now += 1
    bar.advance()
    clock.now += 1
    bar.advance()  # within 5 s: held back
    assert len(out.getvalue().splitlines()) == 1
    bar.close()
    bar.close()  # once only
    assert out.getvalue().splitlines()[-1].startswith("eval: 2/10 examples")


def test_dropped_steps_leave_the_plan_and_the_estimate():
    out, clock = io.StringIO(), Clock()
    bar = Progress(10, "calibrate", "compression", stream=out, clock=clock)
    clock.now += 4
    bar.advance(2)
    bar.drop(4)  # a search ended early
    clock.now += 6
    bar.advance()
    assert out.getvalue().splitlines()[-1] == (
        "calibrate: 3/6 compressions (50%), 10s elapsed, ~10s left")
    bar.drop(3)  # the last search needed nothing more: the job is done
    bar.close()
    assert out.getvalue().splitlines()[-1] == "calibrate: 3/3 compressions (100%), 10s elapsed, done"


def test_a_resumed_job_shows_what_was_done_but_times_this_run_only():
    out, clock = io.StringIO(), Clock()
    bar = Progress(10, "training", stream=out, clock=clock, done=6)
    clock.now += 3
    bar.advance()
    assert out.getvalue().splitlines() == ["training: 7/10 steps (70%), 3s elapsed, ~9s left"]


def test_quiet_prints_nothing_on_a_terminal_or_a_pipe():
    for out in (Terminal(), io.StringIO()):
        with Progress(3, "x", stream=out, quiet=True) as bar:
            bar.advance(3)
        with silenced(), Progress(3, "x", stream=out) as bar:
            bar.advance(3)
        assert out.getvalue() == ""
    with silenced(False), Progress(1, "x", stream=(out := io.StringIO())) as bar:
        bar.advance()
    assert out.getvalue()  # silenced(False) silences nothing


def test_durations_read_as_a_clock():
    assert [duration(s) for s in (0.4, 59, 61, 3599, 3600, 7800)] == \
        ["0s", "59s", "1m01s", "59m59s", "1h00m", "2h10m"]
