"""A one-line progress bar on stderr (weights loading, benchmark requests)."""

from __future__ import annotations

import sys


class ProgressBar:
    """``bar(done, total)`` redraws the line in place on a terminal, or writes a line per
    tenth in a log."""

    def __init__(self, label: str, width: int = 30) -> None:
        self.label = label
        self.width = width
        self.stream = sys.stderr
        self.tty = self.stream.isatty()
        self._last_tenth = -1

    def __call__(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        tenth = int(fraction * 10)
        if not self.tty and tenth == self._last_tenth and done != total:
            return
        self._last_tenth = tenth
        filled = int(fraction * self.width)
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {fraction:4.0%} ({done}/{total})"
        self.stream.write(("\r" + line + ("\n" if done == total else "")) if self.tty else line + "\n")
        self.stream.flush()
