"""Large byte copies, in parts on several threads.

A tensor of many MiB sent to a worker on the same host is copied once into
a shared-memory slot (``shm.py``). One thread copies 16 MiB in ~1.3 ms here,
two in ~0.7: one core's ``memcpy`` does not use all the memory bandwidth. So
a copy of ``PARALLEL_MIN`` bytes or more is cut into parts, one per intra-op
thread torch may use (``torch.get_num_threads()``, at most ``MAX_PARTS``):
the calling thread copies the first and helper threads the others (numpy
copies without the GIL). Measured inside one run of a same-host echo,
alternating block by block: 16 MiB 2.00 -> 1.56 ms, 8 MiB 1.58 -> 1.37 ms;
at 4 MiB and below nothing (waking a helper on two busy cores costs what
its part saves), hence the threshold.

Not torch's own parallel ``copy_`` (16 MiB in 1.49 ms in the same run): its
OpenMP workers spin for a while after each parallel region, and a process
that copies while two others run on the same cores loses those cores to the
spinning (a parameter server with two trainers on two cores: 510-680
updates/s with one thread's copy, 214-264 with torch's). The helpers here
sleep until a part is handed to them.

A part that no helper took yet by the time the caller finished its own is
copied by the caller: a copy waits for a helper only while that helper
copies one of its parts, so it is never much slower than one thread's copy
when every helper is busy with another caller's. A forked child starts
helpers of its own (its parent's are not in it, and their lock may have
been held at the fork).
"""

from __future__ import annotations

import os
import queue
import threading

import numpy as np
import torch

# Copies of this many bytes or more go in parts (see the module doc).
PARALLEL_MIN = 8 << 20
MAX_PARTS = 4
_ALIGN = 4096  # parts start page-aligned in their buffer


class _Part:
    __slots__ = ("target", "source", "taken", "done", "error")

    def __init__(self, target: np.ndarray, source: np.ndarray):
        self.target: np.ndarray | None = target
        self.source: np.ndarray | None = source
        self.taken = threading.Lock()  # held by whoever copies it
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> bool:
        """Copy it unless someone else took it; whether this thread did."""
        if not self.taken.acquire(blocking=False):
            return False
        try:
            self.target[:] = self.source  # type: ignore[index]
        except BaseException as exc:  # for the caller to raise
            self.error = exc
        finally:
            self.target = self.source = None  # a part left queued holds no buffer
            self.done.set()
        return True


class _Helpers:
    """Threads that copy parts handed to them, started as needed (daemons:
    each sleeps in ``queue.get`` between copies, holding nothing)."""

    def __init__(self) -> None:
        self._parts: queue.SimpleQueue[_Part] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._count = 0

    def hand(self, parts: list[_Part]) -> None:
        with self._lock:
            while self._count < len(parts):
                self._count += 1
                threading.Thread(
                    target=self._serve, name=f"rrpc-copy-{self._count}", daemon=True
                ).start()
        for part in parts:
            self._parts.put(part)

    def _serve(self) -> None:
        while True:
            self._parts.get().run()


_helpers = _Helpers()


def _new_helpers_after_fork() -> None:
    global _helpers
    _helpers = _Helpers()


os.register_at_fork(after_in_child=_new_helpers_after_fork)


def copy_bytes(target: np.ndarray, source: np.ndarray | memoryview | bytes) -> None:
    """``target[:] = source`` for one-dimensional byte arrays of one length,
    in parts on several threads when it is ``PARALLEL_MIN`` bytes or more."""
    source = np.frombuffer(source, dtype=np.uint8) if not isinstance(source, np.ndarray) else source
    size = len(target)
    if size != len(source):
        raise ValueError(f"copy of {len(source)} bytes into {size}")
    parts_max = size // (PARALLEL_MIN // 2)  # parts of PARALLEL_MIN / 2 or more
    count = min(torch.get_num_threads(), MAX_PARTS, parts_max) if parts_max >= 2 else 1
    if count < 2:  # the commonest: one slot's copy of less than PARALLEL_MIN
        target[:] = source
        return
    step = -(-size // count // _ALIGN) * _ALIGN
    bounds = [(start, min(start + step, size)) for start in range(0, size, step)]
    parts = [_Part(target[start:end], source[start:end]) for start, end in bounds[1:]]
    _helpers.hand(parts)
    start, end = bounds[0]
    target[start:end] = source[start:end]
    for part in parts:
        part.run()  # any not taken yet: ours
    for part in parts:
        part.done.wait()
        if part.error is not None:
            raise part.error
