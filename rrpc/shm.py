"""Same-host fast path: large tensor buffers through shared memory.

Theory of operation: a sender copies a large buffer once into a *slot* of its
own pool and sends only a descriptor (``SharedBuffer``: segment, offset,
size) over the stream. The receiver maps the segment and builds the tensor
directly over the slot, with no copy. When that tensor (and every view of it)
is freed, the receiver clears the slot's busy byte and the sender may reuse it.

Rules:
- A segment is an anonymous ``memfd``; peers open it through
  ``/proc/<pid>/fd/<fd>``. It has no name in /dev/shm, so nothing is left
  behind when any process dies: the kernel frees it with its last mapping.
- Each segment is one slot: a 64-byte header whose first byte is the busy
  flag, then the data. Only the sender sets it (when it fills the slot), only
  the receiver clears it (when its tensor is gone); a byte store is atomic
  and x86 keeps the receiver's reads of the data ordered before its clear.
- Slots are pre-faulted when created and reused after: new memory costs a
  page fault per 4 KiB here, which is what makes fresh buffers slow.
- A slot remembers the process it was sent to; if that process died without
  freeing it, the slot is taken back when the pool next needs one of its size.
- The path is used only towards peers that proved they can open this
  worker's segments (``probe``); anything else, or a full pool, falls back
  to the stream. ``shared_memory=False`` (env ``RRPC_SHM=0``) turns it off.
- A descriptor is never trusted as it comes off the wire. A receiver maps a
  segment only for the peer whose stream it came on (``Attachments.bind``),
  only in the process that peer advertised (the pid of its probe), only if
  the segment's header carries that peer's pool key (16 random bytes, in
  every segment of the pool and in its probe), and only within the slot's
  bounds. A frame naming anything else (another process's open file, another
  peer's pool) ends that stream before anything is mapped or unpickled.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from rrpc._proto.rrpc_pb2 import SharedBuffer

HEADER = 64
KEY = slice(16, 32)  # where a segment's header holds its pool's key
MAGIC = b"rrpc-shm-probe\x00\x00"
_PAGE = mmap.PAGESIZE


def host_key() -> str:
    """Equal on two workers that can share memory: same boot, pid namespace and user."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot_id}/{pid_namespace}/{os.getuid()}"


class _Segment:
    __slots__ = ("fd", "capacity", "map", "array", "name", "holder")

    def __init__(self, capacity: int, key: bytes):
        self.fd = os.memfd_create("rrpc-shm", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER + capacity)
        self.capacity = capacity
        self.map = mmap.mmap(self.fd, HEADER + capacity)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array[::_PAGE] = 0  # pre-fault every page once
        self.array[KEY] = np.frombuffer(key, dtype=np.uint8)
        self.name = f"{os.getpid()}/{self.fd}"
        self.holder = 0  # pid of the process the slot was last sent to

    @property
    def busy(self) -> bool:
        return self.array[0] != 0


class SenderPool:
    """This worker's slots, by power-of-two capacity."""

    def __init__(self, limit_bytes: int = 8 << 30):
        self._by_capacity: dict[int, list[_Segment]] = {}
        self._lock = threading.Lock()
        self._total = 0
        self._limit = limit_bytes
        self.key = os.urandom(KEY.stop - KEY.start)  # peers check it in every segment
        self.probe = _Segment(_PAGE, self.key)
        self.probe.array[HEADER : HEADER + len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)

    def place(self, raw: memoryview, holder: int = 0) -> SharedBuffer | None:
        """Copy ``raw`` into a free slot for process ``holder`` (its pid);
        None when the pool is at its limit."""
        size = len(raw)
        segment = self._acquire(size, holder)
        if segment is None:
            return None
        segment.array[HEADER : HEADER + size] = np.frombuffer(raw, dtype=np.uint8)
        return SharedBuffer(segment=segment.name, offset=HEADER, size=size)

    def towards(self, holder: int) -> Placer:
        """``place`` bound to one receiving process."""
        return Placer(self, holder)

    def _acquire(self, size: int, holder: int) -> _Segment | None:
        capacity = 1 << max(size - 1, 1).bit_length()
        with self._lock:
            segments = self._by_capacity.setdefault(capacity, [])
            segment = self._free(segments) or self._reclaim(segments)
            if segment is None:
                if self._total + capacity > self._limit:
                    return None
                segment = _Segment(capacity, self.key)
                self._total += capacity
                segments.append(segment)
            segment.array[0] = 1
            segment.holder = holder
            return segment

    @staticmethod
    def _free(segments: list[_Segment]) -> _Segment | None:
        for segment in segments:
            if not segment.busy:
                return segment
        return None

    @staticmethod
    def _reclaim(segments: list[_Segment]) -> _Segment | None:
        """A slot whose receiver died before freeing it: only the receiver
        clears the busy byte, so without this it would stay busy for good."""
        for segment in segments:
            if segment.holder and not _alive(segment.holder):
                return segment
        return None

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            segments = [s for group in self._by_capacity.values() for s in group]
            return {"segments": len(segments), "busy": sum(s.busy for s in segments)}

    def close(self) -> None:
        with self._lock:
            for segment in (s for group in self._by_capacity.values() for s in group):
                os.close(segment.fd)
            self._by_capacity.clear()
        os.close(self.probe.fd)


class Placer:
    """``SenderPool.place`` for one receiving process."""

    __slots__ = ("_pool", "_holder")

    def __init__(self, pool: SenderPool, holder: int):
        self._pool, self._holder = pool, holder

    def place(self, raw: memoryview) -> SharedBuffer | None:
        return self._pool.place(raw, self._holder)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _release(array: np.ndarray) -> None:
    array[0] = 0


class Attachments:
    """Peers' segments mapped by this worker, and tensors built over them."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _map(self, name: str) -> tuple[mmap.mmap, np.ndarray]:
        mapped = self._maps.get(name)
        if mapped is None:
            with self._lock:
                mapped = self._maps.get(name)
                if mapped is None:
                    pid, fd = name.split("/")
                    handle = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDWR)
                    try:
                        segment_map = mmap.mmap(handle, 0)
                    finally:
                        os.close(handle)
                    mapped = segment_map, np.frombuffer(segment_map, dtype=np.uint8)
                    self._maps[name] = mapped
        return mapped

    def bind(self, pid: int, key: bytes) -> Callable[[SharedBuffer], torch.Tensor]:
        """``tensor`` for the segments of one peer: the process ``pid``, whose
        pool has ``key``; any other descriptor raises ValueError unmapped."""
        return functools.partial(self._tensor, pid, key)

    def _tensor(self, pid: int, key: bytes, shared: SharedBuffer) -> torch.Tensor:
        """A uint8 tensor over the slot; freeing it (and its views) frees the slot."""
        owner, _, fd = shared.segment.partition("/")
        if not (owner.isdigit() and fd.isdigit() and int(owner) == pid):
            raise ValueError(
                f"shared buffer {shared.segment!r} is not in the pool of the peer on this "
                f"stream (process {pid})"
            )
        _, whole = self._map(shared.segment)
        if bytes(whole[KEY]) != key:
            raise ValueError(f"shared buffer {shared.segment!r} is not in the peer's pool")
        if shared.offset != HEADER or shared.offset + shared.size > len(whole):
            raise ValueError(f"shared buffer {shared.segment} out of bounds: {shared}")
        data = whole[shared.offset : shared.offset + shared.size]
        weakref.finalize(data, _release, whole)
        return torch.from_numpy(data)

    def can_open(self, probe_name: str, key: bytes) -> bool:
        """Whether ``probe_name`` is a probe this worker can map, of the pool with ``key``."""
        try:
            _, whole = self._map(probe_name)
        except (OSError, ValueError):
            return False
        return bytes(whole[HEADER : HEADER + len(MAGIC)]) == MAGIC and bytes(whole[KEY]) == key

    def forget(self, prefix: str) -> None:
        """Drop the mappings of a peer (its pid prefix) after it went away."""
        with self._lock:
            for name in [name for name in self._maps if name.startswith(prefix)]:
                del self._maps[name]


def tune_allocator() -> None:
    """Keep freed buffers up to 32 MiB in the heap so the next ones reuse
    already-faulted pages (glibc returns larger ones to the OS every time).
    ``RRPC_MALLOC_TUNING=0`` leaves the allocator alone."""
    if os.environ.get("RRPC_MALLOC_TUNING", "1") == "0":
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass
