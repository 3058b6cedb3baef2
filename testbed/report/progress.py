"""A progress bar over a run's finished requests, showing its clock."""

from __future__ import annotations


class Progress:
    """A progress bar over finished requests, showing the run's time. It appears
    at the run's first step, not while the run is being set up (a model built,
    a capacity searched)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.bar = None
        self.done = 0
        self.every = max(1, min(64, total // 100))  # cheap on long runs, live on short ones

    def __call__(self, now: float, num_finished: int) -> None:
        if self.bar is None and self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="req", mininterval=0.5, dynamic_ncols=True)
        if self.bar is not None and num_finished - self.done >= self.every:
            self.bar.update(num_finished - self.done)
            self.done = num_finished
            self.bar.set_postfix_str(f"t={now:,.1f}s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
