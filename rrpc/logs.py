"""One log line per event worth an operator's attention, never one per call.

Events (a refused stream, a malformed frame, a peer declared dead) go to the
``rrpc`` logger at WARNING, each naming the peer (address or worker) and the
reason. The same kind of event from the same peer is logged at most once per
``INTERVAL`` seconds; the next line says how many were left out meanwhile, so
a flood of bad frames costs a log line every few seconds, not one per frame.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("rrpc")

INTERVAL = 10.0  # seconds between two lines of one kind of event from one peer

_lock = threading.Lock()
_last: dict[tuple[str, str], tuple[float, int]] = {}  # (event, peer) -> (logged at, left out)


def event(kind: str, peer: str, message: str, *args: Any, logger: logging.Logger = log) -> None:
    """Log ``message % args`` about ``peer`` unless this ``kind`` was logged
    for it less than ``INTERVAL`` seconds ago (then count it as left out).
    ``logger``: a child of ``rrpc``, for events a user may want to silence alone."""
    now = time.monotonic()
    key = (kind, peer)
    with _lock:
        logged_at, left_out = _last.get(key, (-INTERVAL, 0))
        if now - logged_at < INTERVAL:
            _last[key] = (logged_at, left_out + 1)
            return
        _last[key] = (now, 0)
        if len(_last) > 4096:  # many peers over a long life: forget the oldest half
            for stale in sorted(_last, key=lambda k: _last[k][0])[:2048]:
                del _last[stale]
    suffix = f" ({left_out} more like it in the last {INTERVAL:g} s)" if left_out else ""
    logger.warning("rrpc: " + message + suffix, *args)
