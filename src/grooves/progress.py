"""Where long work is and how long is left: a live bar on a terminal, plain lines in a log.

One ``Reporter`` with two faces, picked from its console: writing to a terminal it draws a
rich bar with the current phase, the last step's seconds, the time spent and, once known,
the time left; writing to a file or a pipe (``make demo > log``, CI) it prints one line per
step, flushed at once::

    validating: 4 held-out tasks (step 0)
    step 1/30  reward 0.381  heldout 0.412 (step 0)  10.4 s
    step 2/30  reward 0.402  heldout 0.412 (step 0)  9.8 s  eta 4m34s

plus a line whenever a phase worth logging starts, so a log never goes silent for minutes.
Phases inside a step (sampling, rewarding, updating, saving) only show on the bar: a log
gets one line per step. ``enabled=False`` (``--quiet``) prints nothing.

The ETA is the mean time of the steps this session completed after its first one, times
the steps left. The first step is left out because it pays one-off costs (lazy imports and
allocations, the first tokenisation of the tasks), so the ETA appears from the second step.

Any loop can use it (training steps, reward-model feature batches, the epochs of a future
``grooves sft``)::

    reporter = Reporter(console)
    reporter.phase("loading", "model bundled:smollm2-135m-instruct")
    with reporter.counting(total=epochs, unit="epoch"):
        for epoch in range(1, epochs + 1):
            reporter.phase("updating", log=False)
            ...
            reporter.advance(epoch, {"loss": f"{loss:.3f}"})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn
from rich.text import Text


def duration(seconds: float) -> str:
    """``45s``, ``4m12s``, ``1h02m``: short enough for a bar, exact enough for a plan."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class _Count:
    """The state of one counted loop: steps done, their timing, the values of the last one."""

    total: int | None
    unit: str
    done: int
    started: float
    every: float
    last: float = 0.0  # clock at the last advance (or the start)
    seconds: float | None = None  # how long the last advance took
    stride: int = 1  # how many units it covered (a batch of texts covers many)
    first: tuple[int, float] | None = None  # (done, clock) after the session's first step
    printed: float = 0.0  # clock at the last line in a log (or the start)
    values: dict[str, str] = field(default_factory=dict)


class Reporter:
    """Phases and step timing of long work, as a bar on a terminal and as lines elsewhere."""

    def __init__(self, console: Console | None = None, *, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        # A terminal that cannot move the cursor (TERM=dumb) gets the plain face too.
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self.clock = clock
        self.current = ""  # the phase now, as shown on the bar
        self._count: _Count | None = None
        self._bar: Progress | None = None

    # --- what callers say ----------------------------------------------------------------

    def phase(self, name: str, detail: str = "", *, log: bool = True) -> None:
        """Work entered phase ``name``. ``log=False``: a phase inside every step, shown on the bar
        only; otherwise a log also gets a line (and a terminal, when no bar is drawn)."""
        self.current = f"{name} {detail}".strip()
        if self.enabled and log and self._bar is None:
            self.print(f"{name}: {detail}" if detail else name)

    @contextmanager
    def counting(self, total: int | None, *, unit: str = "step", done: int = 0,
                 every: float = 0.0) -> Iterator[Reporter]:
        """Count steps ``done + 1 .. total`` (``done``: already finished, e.g. before a resume).
        ``every``: in a log, at most one line per this many seconds (and always the last)."""
        now = self.clock()
        self._count = _Count(total, unit, done, now, every, last=now, printed=now)
        if self.enabled and self.live:
            # The timing comes before the phase and values, so a narrow terminal cuts those first.
            self._bar = Progress(_Callback(self.counter), BarColumn(bar_width=20), _Callback(self.timing),
                                 _Callback(self.status), console=self.console)
            self._bar.add_task(unit, total=total, completed=done)
            self._bar.start()
        try:
            yield self
        finally:
            self.current = ""  # the last drawing shows where the count ended, not its last phase
            if self._bar is not None:
                self._bar.stop()
            self._bar = None
            self._count = None

    def advance(self, done: int, values: dict[str, str] | None = None) -> None:
        """Step ``done`` finished; ``values`` (name -> text, e.g. reward) describe it."""
        count = self._count
        now = self.clock()
        count.seconds, count.stride, count.last, count.done = now - count.last, done - count.done, now, done
        count.values = dict(values or {})
        first = count.first is None
        if first:
            count.first = (done, now)
        if self._bar is not None:
            self._bar.update(self._bar.task_ids[0], completed=done)
        elif self.enabled and (first or done == count.total or now - count.printed >= count.every):
            self.print(self.step_line(now - count.printed))
            count.printed = now

    def print(self, text: str) -> None:
        """A plain line, written (and flushed) at once; above the bar while one is drawn."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    # --- what it shows -------------------------------------------------------------------

    def eta(self) -> float | None:
        """Seconds left after the last step, or None until a step past the first is timed."""
        count = self._count
        if count is None or count.total is None or count.first is None or count.done <= count.first[0]:
            return None
        per_step = (count.last - count.first[1]) / (count.done - count.first[0])
        return per_step * max(0, count.total - count.done)

    def counter(self) -> str:
        count = self._count
        if count is None:
            return ""
        return f"{count.unit} {count.done}/{count.total}" if count.total is not None else f"{count.unit} {count.done}"

    def step_line(self, seconds: float) -> str:
        """The log's line for the last step: ``step 3/30  reward 0.412  9.8 s  eta 4m12s``, where
        ``seconds`` is the time since the previous line (one step unless lines are thinned out)."""
        count = self._count
        parts = [self.counter(), *(f"{name} {value}" for name, value in count.values.items()), f"{seconds:.1f} s"]
        eta = self.eta()
        if eta is not None:
            parts.append(f"eta {duration(eta)}")
        return "  ".join(parts)

    def timing(self) -> str:
        """The bar's clock: time spent, time left (counting down between steps), the last step's seconds."""
        count = self._count
        now = self.clock()
        parts = [f"spent {duration(now - count.started)}"]
        eta = self.eta()
        if eta is not None:
            parts.append(f"eta {duration(max(0.0, eta - (now - count.last)))}")
        if count.seconds is not None:
            parts.append(f"{count.seconds:.1f} s/{count.unit if count.stride == 1 else 'batch'}")
        return "  ".join(parts)

    def status(self) -> str:
        """The bar's words: the phase now and the last step's values."""
        values = self._count.values if self._count is not None else {}
        return "  ".join([p for p in [self.current] if p] + [f"{name} {value}" for name, value in values.items()])


class _Callback(ProgressColumn):
    """A bar column whose text the reporter computes at each refresh."""

    def __init__(self, text: Callable[[], str]):
        super().__init__()
        self.text = text

    def render(self, task) -> Text:
        return Text(self.text(), no_wrap=True, overflow="ellipsis")
