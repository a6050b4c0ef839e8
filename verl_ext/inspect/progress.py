"""Progress lines for scans that take a while, on stderr so that stdout stays the result."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

#: Called by a scan after each step with (steps done, steps in all, valid tokens so far).
Progress = Callable[[int, int, int], None]


class ProgressPrinter:
    """Callable as ``progress(done, total, tokens)``; prints at most one line per ``interval``
    seconds, nothing at all for a scan that ends within ``interval``."""

    def __init__(self, what: str, stream: TextIO | None = None, interval: float = 1.0):
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.started = time.perf_counter()
        self.last_printed = self.started
        self.printed = False

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last_printed < self.interval and not (done == total and self.printed):
            return
        elapsed = now - self.started
        rate = f", {tokens / elapsed / 1e6:.1f}M tokens/s" if elapsed > 0 else ""
        print(
            f"{self.what}: step {done}/{total}, {tokens:,} tokens, {elapsed:.1f} s{rate}", file=self.stream, flush=True
        )
        self.last_printed = now
        self.printed = True
