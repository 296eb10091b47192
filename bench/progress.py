"""Progress of the offline benchmarks (`bench.micro`, `bench.tiers`, `bench.codec_error`)
on stderr: a rich bar with the current step, elapsed time and an ETA, so a run of
minutes is not silent. Standard output keeps only the results."""
from __future__ import annotations


class StepProgress:
    """A progress bar over ``total`` units of work (weighted as the caller sees fit).

    ``advance(n, step=...)`` adds ``n`` units and names what runs next. Disabled (a
    no-op) when ``enabled`` is False. Use as a context manager.
    """

    def __init__(self, label: str, total: float, enabled: bool = True):
        self.label = label
        self.total = total
        self.enabled = enabled
        self._bar = None
        self._task = None

    def __enter__(self) -> "StepProgress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[step]}"), console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, step="")
        return self

    def advance(self, units: float = 1.0, step: str | None = None) -> None:
        if self._bar is not None:
            fields = {} if step is None else {"step": step}
            self._bar.update(self._task, advance=units, **fields)

    def step(self, name: str) -> None:
        """Name what runs now, without advancing."""
        if self._bar is not None:
            self._bar.update(self._task, step=name)

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.stop()
        return False
