"""How much of a process's wall time the tuner may spend timing candidates inside calls.

Timing a new key's candidates runs inside the call that met it (tens of milliseconds a key on a
GPU: compiled candidates timed, guarded and stored). Training on a data set keeps meeting new
keys, since each point cloud's layer sizes fall into new buckets now and then; timed at once,
those keys made half of the passes on unseen street clouds several times slower than the
steady state (H200, 2026-11-28). A token bucket bounds that cost: timing may run while the
bucket holds time; it refills at :data:`SHARE` seconds per second of wall time, up to
:data:`BURST_S`. A key met while the bucket is empty runs the cost model's pick untimed and is
timed by a later call once the bucket has refilled (:meth:`Tuner.run`'s stand-ins), and a call
times at most :data:`PER_CALL` candidates, so that no one pass pays for a whole sweep.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

SHARE = 0.1
"""Share of wall time the tuner may spend timing inside calls, over any long stretch of calls."""
BURST_S = 0.02
"""Timing a process may do at once (its first calls, or after a quiet spell), in seconds: a few candidates. With a
second's burst, the passes that met a street scene's new keys on unseen clouds took 171, 370, 46, 90 and 525 ms
against 16-21 ms once they were timed (H200, 2026-12-01): the burst was spent in one or two passes."""
PER_CALL = 1
"""Candidates a call may time: a key's sweep is spread over its calls, the best candidate timed so far running
in the others (timing one GPU candidate takes ~2-5 ms: its warm-up, ~20 samples, each synchronised)."""


class TimingBudget:
    """A token bucket of timing seconds (see the module docstring); thread-safe."""

    def __init__(self, share: float = SHARE, burst: float = BURST_S, per_call: int | None = PER_CALL,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``per_call``: candidates a call may time (None: a key's whole sweep in the call that meets it)."""
        self.share, self.burst, self.per_call = share, burst, per_call
        self.spent_s = 0.0
        """Seconds of timing charged so far (every sweep's, whether it ran over budget or not)."""
        self._clock = clock
        self._level, self._at = burst, None
        self._lock = threading.Lock()
        self._waived = 0

    def allows(self) -> bool:
        """Whether a call may time candidates now."""
        with self._lock:
            self._refill()
            return self._waived > 0 or self._level > 0.0

    def spend(self, seconds: float) -> None:
        """Charge ``seconds`` of timing (the bucket may go below empty: later calls wait for it to refill)."""
        with self._lock:
            self._refill()
            if not self._waived:
                self._level -= seconds
            self.spent_s += seconds

    @property
    def waiving(self) -> bool:
        """Whether a :meth:`waived` stretch is running: a key met now is timed at once, with no stand-in."""
        return self._waived > 0

    @contextlib.contextmanager
    def waived(self) -> Iterator[None]:
        """Inside the block timing is always allowed and not charged, and keys are timed at once: a moment the
        user chose to tune, whose choices then stay (:func:`sparseconv.warmup`; a graph's capture,
        :mod:`sparseconv.ops.capacity`: a provisional pick captured would run at every replay of the graph)."""
        with self._lock:
            self._waived += 1
        try:
            yield
        finally:
            with self._lock:
                self._waived -= 1

    def _refill(self) -> None:
        now = self._clock()
        if self._at is not None:
            self._level = min(self.burst, self._level + self.share * (now - self._at))
        self._at = now
