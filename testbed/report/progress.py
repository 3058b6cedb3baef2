"""A run's progress over its finished requests: a bar on a terminal, or sparse lines
for a log that cannot redraw a bar in place (a job on Ray)."""

from __future__ import annotations

from testbed.errors import InputError

MODES = (True, False, "lines")
LINES = 10  # "lines" prints the start and each tenth of the requests


class Progress:
    """Progress over finished requests, showing the run's clock, in ``mode``: True a
    tqdm bar, "lines" a line when the first request finishes and at each tenth of
    the requests (each flushed, for a log streamed line by line), False nothing.
    Either appears once requests finish, not while the run is being set up (a
    model built, a capacity searched)."""

    def __init__(self, total: int, mode: bool | str) -> None:
        if mode not in MODES:
            raise InputError(f"progress: {mode!r} is not one of true, false or lines")
        self.total, self.mode = total, mode
        self.bar = None
        self.done = 0
        self.every = max(1, min(64, total // 100))  # cheap on long runs, live on short ones
        self.next_line = 0  # the count at which "lines" prints next
        self.now, self.finished = 0.0, 0  # the latest call's clock and count

    def __call__(self, now: float, num_finished: int) -> None:
        self.now, self.finished = now, num_finished
        if self.mode == "lines":
            if num_finished >= self.next_line:
                self.line()
            return
        if self.bar is None and self.mode:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="req", mininterval=0.5, dynamic_ncols=True)
        if self.bar is not None and num_finished - self.done >= self.every:
            self.bar.update(num_finished - self.done)
            self.done = num_finished
            self.bar.set_postfix_str(f"t={now:,.1f}s", refresh=False)

    def line(self) -> None:
        """Print where the run stands; the next line is due at the next tenth."""
        print(f"{self.finished}/{self.total} requests finished, t={self.now:,.1f}s", flush=True)
        self.done = self.finished
        step = max(1, -(-self.total // LINES))
        self.next_line = (self.finished // step + 1) * step

    def close(self) -> None:
        """End the bar; in "lines", print the final count where it was not the last
        line (a run stopped between tenths)."""
        if self.bar is not None:
            self.bar.close()
        elif self.mode == "lines" and self.next_line and self.finished != self.done:
            self.line()
