"""`progress_bar`: the replay's console progress bar (rich), or a no-op without a console."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class progress_bar:
    """Context manager yielding `advance(done)`; a rich bar when a console is given, else a no-op."""

    def __init__(self, console: Console | None, total: int, label: str) -> None:
        self.console, self.total, self.label = console, total, label
        self._progress: Progress | None = None

    def __enter__(self) -> Callable[[int], None]:
        if self.console is None:
            return lambda done: None

        progress = self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        progress.start()
        task: TaskID = progress.add_task(self.label, total=self.total)
        last = [0.0]

        def advance(done: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or done >= self.total:
                last[0] = now
                progress.update(task, completed=done)

        return advance

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
