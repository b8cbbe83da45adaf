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
  page fault per 4 KiB here, which is what makes fresh buffers slow. A slot
  is made outside the pool's lock: the buffer that needs it waits for it,
  no other buffer does.
- A reply that sends back (part of) a tensor the peer's slot carried here —
  an echo, a function returning its argument or a view of it — is not copied
  into a slot of this worker: its descriptor names the peer's own slot
  (``returned``), and the peer copies it out into a fresh tensor when the
  reply arrives. The slot's second byte is the peer's hold on it: set by
  this worker before the reply leaves, cleared by the peer once it copied; a
  slot is reused only when both bytes are clear. So the server of a 128 MiB
  echo holds no copy of the payload, as TensorPipe's cma channel streams the
  reply from the received tensor. When the reply arrives, a slot the server
  still maps a tensor over (byte 0 set: it kept what it was sent) is copied
  out, and the hold cleared at once: what the server does to its tensor
  afterwards is never seen; what it writes into it between the reply leaving
  and arriving is (as with the cma channel, which reads the server's tensor
  when the reply arrives). A slot it maps no longer is the reply tensor
  itself, with no copy, and the hold is cleared when that tensor is freed.
- A slot remembers the process it was sent to; if that process died without
  freeing it, the slot is taken back when the pool next needs one of its size.
- The receiver sets the slot's third byte (``SEEN``) when it reads the frame
  that names it. Slots sent in replies and not seen yet are what a caller
  that does not read its replies makes this worker hold: ``Unseen`` counts
  them, and the stream's reader stops reading that caller's requests while
  they pass ``REPLY_BACKLOG`` (as for replies waiting unsent in the stream).
  A slot seen and kept alive by the receiver is its memory, not a backlog.
- The path is used only towards peers that proved they can open this
  worker's segments (``probe``); anything else, or a full pool (its byte
  limit, or no file descriptor left for a new slot), falls back to the
  stream. ``shared_memory=False`` (env ``RRPC_SHM=0``) turns it off.
- A descriptor is never trusted as it comes off the wire. A receiver maps a
  segment only for the peer whose stream it came on (``Attachments.bind``),
  only in the process that peer advertised (the pid of its probe), only if
  the segment's header carries that peer's pool key (16 random bytes, in
  every segment of the pool and in its probe), and only within the slot's
  bounds. A frame naming anything else (another process's open file, another
  peer's pool) ends that stream before anything is mapped or unpickled.
"""

from __future__ import annotations

import collections
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from rrpc import copies
from rrpc._proto.rrpc_pb2 import SharedBuffer

HEADER = 64
SEEN = 2  # the header byte its receiver sets once it read the frame naming the slot
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
    __slots__ = ("fd", "capacity", "map", "array", "name", "holder", "uses")

    def __init__(self, capacity: int, key: bytes):
        self.fd = os.memfd_create("rrpc-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, HEADER + capacity)
            self.map = mmap.mmap(self.fd, HEADER + capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.capacity = capacity
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array[::_PAGE] = 0  # pre-fault every page once
        self.array[KEY] = np.frombuffer(key, dtype=np.uint8)
        self.name = f"{os.getpid()}/{self.fd}"
        self.holder = 0  # pid of the process the slot was last sent to
        self.uses = 0  # times it was filled: tells one sending of it from the next

    @property
    def busy(self) -> bool:
        """Held by its receiver (byte 0) or by this worker, copying a reply
        that returned it (byte 1)."""
        return self.array[0] != 0 or self.array[1] != 0


def capacity_for(size: int) -> int:
    """The slot capacity a buffer of ``size`` bytes takes: a size class in
    quarter steps between powers of two (256, 320, 384, 448, 512, 640 KiB,
    ...), so that a slot a receiver keeps wastes at most a fifth of its size
    (powers of two alone wasted up to half)."""
    step = max((1 << max(size - 1, 1).bit_length()) >> 3, 1)
    return -(-size // step) * step


class SenderPool:
    """This worker's slots, by capacity (``capacity_for``). A buffer takes a
    free slot of its own size class, else a free one of a larger class up to
    twice its capacity, else a new slot of its class."""

    def __init__(self, limit_bytes: int = 8 << 30):
        self._by_capacity: dict[int, list[_Segment]] = {}
        self._by_name: dict[str, _Segment] = {}
        self._lock = threading.Lock()
        self._total = 0  # the capacity of the slots, and of those being made
        self._limit = limit_bytes
        self._closed = False
        self.key = os.urandom(KEY.stop - KEY.start)  # peers check it in every segment
        self.probe = _Segment(_PAGE, self.key)
        self.probe.array[HEADER : HEADER + len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)

    def place(
        self, raw: memoryview, holder: int = 0, unseen: Unseen | None = None
    ) -> SharedBuffer | None:
        """Copy ``raw`` into a free slot for process ``holder`` (its pid);
        None when the pool is at its limit. ``unseen`` counts the slot until
        the receiver reads it."""
        size = len(raw)
        segment = self._acquire(size, holder)
        if segment is None:
            return None
        copies.copy_bytes(segment.array[HEADER : HEADER + size], raw)
        if unseen is not None:
            unseen.add(segment)
        return SharedBuffer(segment=segment.name, offset=HEADER, size=size)

    def towards(self, holder: int, attachments: Attachments | None = None) -> Placer:
        """``place`` bound to one receiving process (which may be sent its own
        slots back: those ``attachments`` mapped from it)."""
        return Placer(self, holder, attachments)

    def take_back(self, shared: SharedBuffer, holder: int) -> torch.Tensor:
        """A copy of a slot of this pool that process ``holder`` returned (see
        the rules); the slot's hold is cleared. Raises ValueError for a slot
        not of this pool, not sent to ``holder``, not marked returned, or out
        of its bounds."""
        segment = self._by_name.get(shared.segment)
        if segment is None or segment.holder != holder:
            raise ValueError(f"returned buffer {shared.segment!r} was not sent to process {holder}")
        end = shared.offset + shared.size
        if not (HEADER <= shared.offset and end <= HEADER + segment.capacity):
            raise ValueError(f"returned buffer {shared.segment} out of bounds: {shared}")
        if not segment.array[1]:
            raise ValueError(f"returned buffer {shared.segment!r} is not marked returned")
        data = segment.array[shared.offset : end]
        if not segment.array[0]:  # the peer maps no tensor over it any more: ours alone
            weakref.finalize(data, _unhold, segment.array)
            return torch.from_numpy(data)
        copy = np.empty(shared.size, dtype=np.uint8)
        copies.copy_bytes(copy, data)
        segment.array[1] = 0
        return torch.from_numpy(copy)

    def _acquire(self, size: int, holder: int) -> _Segment | None:
        capacity = capacity_for(size)
        with self._lock:
            segments = self._by_capacity.setdefault(capacity, [])
            segment = self._free(segments) or self._reclaim(segments) or self._larger(capacity)
            if segment is not None:
                return self._take(segment, holder)
            if self._total + capacity > self._limit:
                return None
            self._total += capacity  # reserved while the slot is made
        # Made outside the lock: pre-faulting takes milliseconds per MiB (~100
        # ms for 128 MiB here), which no other buffer of this worker waits for.
        try:
            segment = _Segment(capacity, self.key)
        except BaseException as exc:
            with self._lock:
                self._total -= capacity
            if isinstance(exc, OSError):  # out of file descriptors (one per slot) or memory
                return None
            raise
        with self._lock:
            if self._closed:
                os.close(segment.fd)
                return None
            segments.append(segment)
            self._by_name[segment.name] = segment
            return self._take(segment, holder)

    @staticmethod
    def _take(segment: _Segment, holder: int) -> _Segment:
        """Mark a slot filled for process ``holder`` (under the lock)."""
        segment.array[0] = 1
        segment.array[SEEN] = 0
        segment.uses += 1
        segment.holder = holder
        return segment

    @staticmethod
    def _free(segments: list[_Segment]) -> _Segment | None:
        for segment in segments:
            if not segment.busy:
                return segment
        return None

    def _larger(self, capacity: int) -> _Segment | None:
        """A free slot of the smallest larger class up to twice ``capacity``
        (sizes that vary a little reuse slots instead of faulting in new ones)."""
        for larger in sorted(self._by_capacity):
            if capacity < larger <= 2 * capacity:
                found = self._free(self._by_capacity[larger])
                if found is not None:
                    return found
        return None

    @staticmethod
    def _reclaim(segments: list[_Segment]) -> _Segment | None:
        """A slot whose receiver died before freeing it: only the receiver
        clears the busy byte, so without this it would stay busy for good."""
        for segment in segments:
            if segment.holder and not segment.array[1] and not _alive(segment.holder):
                return segment
        return None

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            segments = [s for group in self._by_capacity.values() for s in group]
            return {"segments": len(segments), "busy": sum(s.busy for s in segments)}

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a slot still being made is closed when it is
            for segment in (s for group in self._by_capacity.values() for s in group):
                os.close(segment.fd)
            self._by_capacity.clear()
        os.close(self.probe.fd)


class Placer:
    """``SenderPool.place`` for one receiving process: its own slot back when
    ``raw`` lies in one this worker maps from it, else a copy into ours.
    ``unseen``: the slots of replies to it that it has not read yet."""

    __slots__ = ("_pool", "_holder", "_attachments", "unseen")

    def __init__(self, pool: SenderPool, holder: int, attachments: Attachments | None = None):
        self._pool, self._holder, self._attachments = pool, holder, attachments
        self.unseen = Unseen()

    def place(self, raw: memoryview, reply: bool = False) -> SharedBuffer | None:
        if self._attachments is not None:
            returned = self._attachments.returnable(raw, self._holder)
            if returned is not None:
                return returned  # its own slot: nothing of ours waits on it
        return self._pool.place(raw, self._holder, self.unseen if reply else None)


class Unseen:
    """Slots sent in replies to one process that it has not read yet.

    Nothing tells the sender when a receiver reads a slot (it sets the slot's
    ``SEEN`` byte), so the count only grows as slots are sent, and is made
    exact (the slots seen since dropped) only when it passes a limit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: collections.deque[tuple[_Segment, int]] = collections.deque()
        self.bytes = 0  # at least the bytes of the slots not seen yet

    def add(self, segment: _Segment) -> None:
        with self._lock:
            self._slots.append((segment, segment.uses))
            self.bytes += segment.capacity

    def over(self, limit: int) -> bool:
        """Whether more than ``limit`` bytes of slots are not seen yet."""
        if self.bytes <= limit:
            return False
        with self._lock:
            waiting = collections.deque(
                (segment, uses)
                for segment, uses in self._slots
                # The same sending of it (not freed and filled again), unread.
                if segment.uses == uses and segment.array[0] and not segment.array[SEEN]
            )
            self._slots = waiting
            self.bytes = sum(segment.capacity for segment, _ in waiting)
            return self.bytes > limit

    def forget(self) -> None:
        with self._lock:
            self._slots.clear()
            self.bytes = 0

    def wait_for_room(self, limit: int, ended: Callable[[], object]) -> bool:
        """Wait while more than ``limit`` bytes are not seen; False if
        ``ended()`` meanwhile. It looks every ``LOOK_EVERY`` seconds: the
        receiver's reads change shared bytes, which wake no one here."""
        looked = None  # an Event never set, for the wait between looks, once needed
        while self.over(limit):
            if ended():
                return False
            looked = looked or threading.Event()
            looked.wait(LOOK_EVERY)
        return True


LOOK_EVERY = 0.001


def _unhold(array: np.ndarray) -> None:
    array[1] = 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not). When /proc
    cannot be read for another reason than the process being gone (no file
    descriptor left), it counts as running: taking back a live receiver's
    slot would overwrite a tensor it holds."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        return True


class Attachments:
    """Peers' segments mapped by this worker, and tensors built over them."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        self._lock = threading.Lock()
        # The slot data of tensors alive here, by address: (end, segment, its
        # whole map, the owner's pid); a reply within one may return it.
        self._lent: dict[int, tuple[int, str, np.ndarray, int]] = {}

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

    def bind(
        self, pid: int, key: bytes, own: SenderPool | None = None
    ) -> Callable[[SharedBuffer], torch.Tensor]:
        """``tensor`` for the segments of one peer: the process ``pid``, whose
        pool has ``key`` (and slots of ``own`` that it returns); any other
        descriptor raises ValueError unmapped."""
        return functools.partial(self._tensor, pid, key, own)

    def _tensor(
        self, pid: int, key: bytes, own: SenderPool | None, shared: SharedBuffer
    ) -> torch.Tensor:
        """A uint8 tensor over the slot; freeing it (and its views) frees the slot."""
        if shared.returned:
            if own is None:
                raise ValueError("a returned shared buffer, and this worker sent none")
            return own.take_back(shared, pid)
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
        whole[SEEN] = 1  # read: the sender no longer counts it as waiting for us
        data = whole[shared.offset : shared.offset + shared.size]
        start = data.ctypes.data
        with self._lock:
            self._lent[start] = (start + shared.size, shared.segment, whole, pid)
        weakref.finalize(data, self._release, start, whole)
        return torch.from_numpy(data)

    def _release(self, start: int, whole: np.ndarray) -> None:
        with self._lock:
            self._lent.pop(start, None)
        whole[0] = 0

    def returnable(self, raw: memoryview, pid: int) -> SharedBuffer | None:
        """``raw``'s bytes as process ``pid``'s own slot, marked returned, when
        they lie in a slot this worker maps from it; else None."""
        if not self._lent:
            return None
        begin = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        end = begin + len(raw)
        with self._lock:
            for start, (stop, name, whole, owner) in self._lent.items():
                if owner == pid and start <= begin and end <= stop:
                    if whole[1]:  # returned already, and not yet taken back
                        return None
                    whole[1] = 1
                    offset = HEADER + begin - start
                    return SharedBuffer(segment=name, offset=offset, size=len(raw), returned=True)
        return None

    def can_open(self, probe_name: str, key: bytes) -> bool:
        """Whether ``probe_name`` is a probe this worker can map, of the pool with ``key``."""
        try:
            _, whole = self._map(probe_name)
        except (OSError, ValueError):
            return False
        return bytes(whole[HEADER : HEADER + len(MAGIC)]) == MAGIC and bytes(whole[KEY]) == key

    def forget(self, prefix: str) -> None:
        """Drop the mappings of a peer (its pid prefix, ``"<pid>/"``) after it
        went away. A tensor still over one of its slots keeps that slot's map
        (the slot's array is its numpy base) until it is freed."""
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
