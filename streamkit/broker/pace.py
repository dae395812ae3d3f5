"""How long an appender may take to send its content, while it holds the journal.

An append holds its journal's append lock from its first chunk to its
commit, so a client that sends slowly holds every other appender of the
journal. As Gazette's brokers do, an append must keep up a minimum rate
(64 KiB/s by default): each byte received earns 1/min_rate seconds, on top of
a small allowance for the round trips of a short append, and an appender
that falls behind is aborted and rolled back. Independently no single wait
for a chunk may exceed the stall timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from streamkit.errors import StreamkitError

__all__ = ["DEFAULT_MIN_APPEND_RATE", "AppendPace", "TooSlow"]

DEFAULT_MIN_APPEND_RATE = 64 << 10  # bytes per second, Gazette's default
ALLOWANCE = 2.0  # seconds any append has beyond what its bytes earned


class TooSlow(StreamkitError, TimeoutError):
    """The appender fell below the minimum rate, or stalled; the append is rolled back."""


class AppendPace:
    """The deadline of an append's next chunk: see the module docstring."""

    def __init__(self, min_rate: float, stall_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_rate = min_rate
        self.clock = clock
        self.stall_timeout = stall_timeout
        # Set when the first chunk is awaited, which is once the append holds the journal:
        # a wait for the append lock behind another appender is not the appender's doing.
        self.started = 0.0
        self.received = 0

    def next_timeout(self) -> float:
        """Seconds to wait for the next chunk (at least a little, so a timer can fire)."""
        if not self.started:
            self.started = self.clock()
        if self.min_rate <= 0:
            return self.stall_timeout
        earned = self.started + ALLOWANCE + self.received / self.min_rate - self.clock()
        return max(0.001, min(self.stall_timeout, earned))

    def got(self, size: int) -> None:
        self.received += size

    def timed_out(self, journal: str) -> TooSlow:
        elapsed = self.clock() - self.started
        if self.min_rate > 0 and elapsed > ALLOWANCE + self.received / self.min_rate:
            return TooSlow(
                f"append to {journal} sent {self.received} bytes in {elapsed:.1f}s, below the "
                f"minimum rate of {self.min_rate / 1024:g} KiB/s; rolled back")
        return TooSlow(f"append to {journal} stalled for {self.stall_timeout:g}s; rolled back")
