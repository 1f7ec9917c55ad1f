"""One status line redrawn in place on a terminal: the training progress bar and
`data.prepare`'s document count. Not on a terminal (a log file, a pipe) nothing is redrawn, so
logs stay free of `\\r`."""

from __future__ import annotations


def is_interactive(stream) -> bool:
    """True when `stream` is a terminal, where redrawing a line with `\\r` makes sense."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class StatusLine:
    """`line.due(now)` says whether `min_interval` seconds have passed since the last `draw`;
    `draw(text)` replaces the line; `clear()` wipes it before other output; `finish()` leaves it
    on screen with the cursor below."""

    def __init__(self, stream, min_interval: float):
        self.stream, self.min_interval = stream, min_interval
        self.interactive = is_interactive(stream)
        self._length = 0  # characters on screen; 0 when nothing is
        self._drawn_at = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._drawn_at >= self.min_interval

    def draw(self, text: str, now: float) -> None:
        # Padded with spaces to wipe the rest of a longer previous line.
        self.stream.write("\r" + text.ljust(self._length))
        self.stream.flush()
        self._length, self._drawn_at = len(text), now

    def clear(self) -> None:
        if self._length:
            self.stream.write("\r" + " " * self._length + "\r")
            self._length = 0

    def finish(self) -> None:
        if self._length:
            self.stream.write("\n")
            self._length = 0
        self.stream.flush()
