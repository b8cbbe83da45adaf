"""Waiting for a peer's next message: look for it a little before sleeping.

A thread that sleeps until bytes come is woken by them, which on a virtual
machine is a cross-CPU interrupt costing tens of microseconds at each end of
a round trip. A reader that keeps looking for a short while (``Spin.wait``)
meets the bytes of a quick answer, or of a sequential caller's next request,
without that wake-up. Two readers use it: a lane's (``lane_io.Reader``,
either end) and a gRPC stream's callee waiting for its next request
(``grpc_serve.Served``; a gRPC caller cannot: grpcio gives its calls no wait
with a time limit).

Past its first ``SPIN_ALONE`` seconds a spin yields the CPU at every look
(``sched_yield``): a thread that wants this CPU (the other end's
computation, torch's OpenMP workers, a third process) gets it at once, and
the spinner looks again when it is given the CPU back. A spin that kept the
CPU slowed what it waited for, so it was held to 200 µs, and longer waits (a
forward pass, a 1 MiB echo, a reply behind another process's turn on the
CPU) slept and paid the wake-up. Measured on a lane inside one run,
alternating block by block with that rule (200 µs, never yielding): the
distributed-autograd step 0.93-1.21x (six runs, median 1.08x), the RL example
(three processes on two cores) 1.06-1.25x, 64 threads' calls 1.10-1.28x, 64 in
flight 0.98-1.06x, ``remote().to_here()`` 1.04-1.07x, a no-op call
1.03-1.04x, a 1 MiB echo 1.09x, 64 KiB and 512 KiB echoes 0.99-1.01x, a 4 KiB
echo 0.99x; every echo's p99 lower. The parameter server (two trainers and a
server on two saturated cores) 0.94-1.04x (six runs, median 0.96x), likely
because a spinning thread, yielding or not, keeps its CPU from looking idle to
the scheduler, which places a woken thread on an idle CPU first (napping 1 µs
between looks instead of yielding: 0.97x there too). Spinning only at the
caller's end kept the parameter server whole (1.03x) but lost the autograd
step's gain (0.97x) and 64 threads' (0.99x): the callee's waits between a
caller's requests are what those lose to wake-ups.

A reader spins only while most of its recent waits ended within ``spin``
(``_hits``, a moving average): a caller waiting on long calls, or a callee
whose caller pauses between calls, sleeps at once as it would without it. A
wait slept through is measured with its wake-up in it, which can make a short
wait look long, so one wait in ``PROBE_EVERY`` spins regardless: a reader that
stopped spinning starts again once waits are short. A probe that waits in
vain doubles the interval to the next one (up to ``PROBE_MAX``), a short wait
sets it back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Spin:
    """One reader's spinning: ``spin`` seconds of looking before a sleep (0: never)."""

    PROBE_EVERY = 8
    PROBE_MAX = 1024
    SPIN_ALONE = 50e-6  # seconds of a spin that keep the CPU: a short wait's bytes seen at once

    def __init__(self, spin: float = 0.0):
        self.spin = spin
        self._hits = 1.0  # the share of recent waits that ended within ``spin``
        self._waits = 0
        self._probe_every = self.PROBE_EVERY  # while spinning is off: one wait in this many spins

    def wait(
        self, look: Callable[[Any], T], at_once: Any, sleep: Callable[[Any], T], limit: Any
    ) -> T:
        """What ``look(at_once)`` (which must not block) finds, spinning first
        while waits have been short, or else what ``sleep(limit)`` (which
        blocks, ``limit`` its time limit in the sleeper's own terms) returns.
        A lane passes its ``poll`` for both: the spin calls no Python function
        per look, and holds the GIL the shorter between them."""
        spin = self.spin
        if not spin:
            return sleep(limit)
        self._waits += 1
        start = time.perf_counter()
        probe = self._hits < 0.5 and self._waits % self._probe_every == 0
        if self._hits >= 0.5 or probe:
            end = start + spin
            alone = start + self.SPIN_ALONE
            while not (found := look(at_once)):
                now = time.perf_counter()
                if now >= end:
                    found = sleep(limit)
                    break
                if now >= alone:
                    os.sched_yield()
        else:
            found = sleep(limit)
        hit = time.perf_counter() - start < spin
        self._hits += (hit - self._hits) / 4
        if hit:
            self._probe_every = self.PROBE_EVERY
        elif probe:
            self._probe_every = min(2 * self._probe_every, self.PROBE_MAX)
        return found
