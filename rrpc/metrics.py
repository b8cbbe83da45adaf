"""Metrics: what a worker counts of its calls, per peer and per function, and a Prometheus endpoint.

Rules

- Always on, and cheap: a call costs a few attribute increments on one row
  (its cell: its peer and its function), one histogram bucket per reply,
  and the function's name; the rows by peer and by function are the sums
  of the cells, made when they are read (``rrpc.stats()``, a scrape), not
  on the call's path (``benchmarks/bench.py --overhead``). No lock: with the GIL of CPython
  3.11+ an attribute or list-item increment has no thread switch inside it
  (older ones may rarely lose one), and rows are written only through the
  functions below.
- Memory is bounded: a latency histogram has a fixed number of buckets, and
  there is at most ``MAX_FUNCTIONS`` functions (the rest are counted under
  ``OTHER_FUNCTIONS``), so at most that many cells per peer and one more.
- The agent calls ``Metrics.sent`` and then ``answered`` (``undecodable``),
  ``ended`` or ``late`` for the calls it sends, ``Metrics.served`` and then
  ``replied`` for the requests it serves; nothing here knows about streams
  or threads. ``rrpc.stats()`` and the
  Prometheus endpoint read the same rows.

What a row counts (``Row.as_dict``)

- Calls this worker sent: ``calls_sent``; ``replies`` (answered, a value or
  an error); ``errors`` (ended with an error: the callee raised, the reply did
  not decode, the peer was lost, rrpc shut down); ``timeouts``; ``in_flight``
  (sent, not ended yet); latency from send to reply: ``latency_total`` (s),
  ``latency_mean_us``, ``latency_p50_us``, ``latency_p99_us``.
- Requests this worker served: ``calls_served``, ``errors_served`` (the
  function raised, or its reply could not be encoded).
- Traffic both ways (requests and replies): ``bytes_sent``,
  ``bytes_received`` (whole frames), ``tensor_bytes_sent``,
  ``tensor_bytes_received`` (tensors' bytes among them).

Rows are keyed by peer name and by function: a call's function is its
``module.qualname`` (``torch.add``, ``__main__.train``), a ``remote()``'s the
function it runs, and an RRef or autograd protocol message its kind
(``RREF_FETCH``, ``AUTOGRAD_BACKWARD``, ...).

Latency histogram: ``SUB`` buckets per doubling from 1 µs to 2^33 µs (2.4 h),
one below, the last holding the rest; a percentile is the middle of the
bucket it falls in, within 6.25 % of the true sample.
"""

from __future__ import annotations

import math
import types
from bisect import bisect_right
from collections.abc import Callable, Iterator
from typing import Any

from rrpc.messages import CALL, KIND_NAMES, PROFILED, RREF_CREATE, RpcError

SUB = 8  # histogram buckets per doubling of latency
_DOUBLINGS = 33
BUCKETS = 2 + _DOUBLINGS * SUB  # [0, 1 µs), SUB per doubling up to 2^33 µs, then the rest
MAX_FUNCTIONS = 1000
OTHER_FUNCTIONS = "(other functions)"


def bucket_bounds(index: int) -> tuple[float, float]:
    """The latencies in microseconds, [low, high), that bucket ``index`` holds."""
    if index == 0:
        return 0.0, 1.0
    if index == BUCKETS - 1:
        return 2.0**_DOUBLINGS, math.inf
    doubling, step = divmod(index - 1, SUB)
    base = 2.0**doubling
    return base * (1 + step / SUB), base * (1 + (step + 1) / SUB)


# The lowest latency of each bucket but the first, in microseconds: a
# latency's bucket is how many of them it reaches (one C call per reply).
_LOWS = [bucket_bounds(index)[0] for index in range(1, BUCKETS)]


def bucket_of(seconds: float) -> int:
    """The histogram bucket of a latency."""
    return bisect_right(_LOWS, seconds * 1e6)


class Row:
    """The counters of one peer or one function (see the module doc)."""

    __slots__ = (
        "calls_sent",
        "calls_served",
        "replies",
        "errors",
        "timeouts",
        "errors_served",
        "ended",
        "bytes_sent",
        "bytes_received",
        "tensor_bytes_sent",
        "tensor_bytes_received",
        "latency_total",
        "latency",
    )

    def __init__(self) -> None:
        self.calls_sent = self.calls_served = self.replies = self.errors = 0
        self.timeouts = self.errors_served = self.ended = 0
        self.bytes_sent = self.bytes_received = 0
        self.tensor_bytes_sent = self.tensor_bytes_received = 0
        self.latency_total = 0.0  # seconds, over replies
        self.latency: list[int] | None = None  # histogram counts, once a reply came

    @property
    def in_flight(self) -> int:
        return self.calls_sent - self.ended

    def percentile_us(self, q: float) -> float:
        """The latency (µs) under which a fraction ``q`` of the replies came; 0 if none."""
        counts, total = self.latency, self.replies
        if counts is None or not total:
            return 0.0
        rank = max(1, math.ceil(q * total))
        seen = 0
        for index, count in enumerate(counts):
            seen += count
            if seen >= rank:
                low, high = bucket_bounds(index)
                return (low + high) / 2 if high != math.inf else low
        return 0.0  # counts raced ahead of replies: read again

    def cumulative_buckets(self) -> Iterator[tuple[float, int]]:
        """(upper bound in seconds, replies at most that slow) at every doubling."""
        counts = self.latency or [0] * BUCKETS
        seen = counts[0]
        for doubling in range(_DOUBLINGS + 1):
            yield 2.0**doubling / 1e6, seen
            seen += sum(counts[1 + doubling * SUB : 1 + (doubling + 1) * SUB])

    def as_dict(self) -> dict[str, float]:
        return {
            "calls_sent": self.calls_sent,
            "calls_served": self.calls_served,
            "replies": self.replies,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "errors_served": self.errors_served,
            "in_flight": self.in_flight,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "tensor_bytes_sent": self.tensor_bytes_sent,
            "tensor_bytes_received": self.tensor_bytes_received,
            "latency_total": self.latency_total,
            "latency_mean_us": 1e6 * self.latency_total / self.replies if self.replies else 0.0,
            "latency_p50_us": self.percentile_us(0.5),
            "latency_p99_us": self.percentile_us(0.99),
        }

    def add(self, other: Row) -> None:
        """Count ``other``'s calls in this row too (a sum of cells)."""
        for name in Row.__slots__:
            if name != "latency":
                setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.latency is not None:
            if self.latency is None:
                self.latency = [0] * BUCKETS
            self.latency = [a + b for a, b in zip(self.latency, other.latency, strict=True)]


class Metrics:
    """One worker's rows: a cell per peer and function, summed by peer and
    by function when read."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], Row] = {}
        self._functions: set[str] = set()
        self._late: dict[str, Row] = {}  # a peer's replies that came after their call ended

    def cell(self, peer: str, function: str) -> Row:
        """The row of ``peer``'s calls of ``function`` (made at its first call)."""
        row = self.cells.get((peer, function))
        if row is None:
            if function not in self._functions:
                if len(self._functions) >= MAX_FUNCTIONS:
                    function = OTHER_FUNCTIONS
                self._functions.add(function)
            row = self.cells.setdefault((peer, function), Row())
        return row

    def late_row(self, peer: str) -> Row:
        """Where a reply to ``peer``'s call that ended already is counted (``late``)."""
        row = self._late.get(peer)
        if row is None:
            row = self._late.setdefault(peer, Row())
        return row

    @property
    def peers(self) -> dict[str, Row]:
        """A row per peer: the sum of its cells (a snapshot)."""
        summed: dict[str, Row] = {}
        for (peer, _), cell in list(self.cells.items()):
            summed.setdefault(peer, Row()).add(cell)
        for peer, row in list(self._late.items()):
            summed.setdefault(peer, Row()).add(row)
        return summed

    @property
    def functions(self) -> dict[str, Row]:
        """A row per function: the sum of its cells (a snapshot)."""
        summed: dict[str, Row] = {}
        for (_, function), cell in list(self.cells.items()):
            summed.setdefault(function, Row()).add(cell)
        return summed

    def sent(self, peer: str, kind: int, obj: Any, size: int, tensor_bytes: int) -> Row:
        """A request went to ``peer``; the row its reply will count in."""
        row = self.cell(peer, function_of(kind, obj))
        row.calls_sent += 1
        row.bytes_sent += size
        row.tensor_bytes_sent += tensor_bytes
        return row

    def served(self, peer: str, kind: int, request: Any, size: int, tensor_bytes: int) -> Row:
        """A request came from ``peer`` (``request``: decoded, or None if it did not decode)."""
        name = function_of(kind, request) if request is not None else kind_label(kind)
        row = self.cell(peer, name)
        row.calls_served += 1
        row.bytes_received += size
        row.tensor_bytes_received += tensor_bytes
        return row


def answered(row: Row, size: int, tensor_bytes: int, latency: float, error: bool) -> None:
    """The reply to a call sent came, ``latency`` seconds after it went."""
    row.replies += 1
    row.ended += 1
    row.bytes_received += size
    row.tensor_bytes_received += tensor_bytes
    row.latency_total += latency
    counts = row.latency
    if counts is None:
        counts = row.latency = [0] * BUCKETS
    counts[bucket_of(latency)] += 1
    if error:
        row.errors += 1


def undecodable(row: Row) -> None:
    """A reply (not an error reply) that did not decode: the call failed."""
    row.errors += 1


def ended(row: Row, timed_out: bool) -> None:
    """A call sent ended without a reply: its deadline passed, or it failed."""
    row.ended += 1
    if timed_out:
        row.timeouts += 1
    else:
        row.errors += 1


def late(row: Row, size: int, tensor_bytes: int) -> None:
    """A reply that came after its call had ended: traffic all the same."""
    row.bytes_received += size
    row.tensor_bytes_received += tensor_bytes


def replied(row: Row, size: int, tensor_bytes: int, error: bool) -> None:
    """A request served was answered (``error``: with an error)."""
    row.bytes_sent += size
    row.tensor_bytes_sent += tensor_bytes
    if error:
        row.errors_served += 1


def kind_label(kind: int) -> str:
    return KIND_NAMES.get(kind & ~PROFILED) or f"kind {kind}"


def function_of(kind: int, obj: Any) -> str:
    """The function row of a message: what a call or remote() runs, else its kind."""
    try:
        if kind & PROFILED:
            kind, obj = kind & ~PROFILED, obj[1]
        if kind == CALL:
            return function_name(obj[0])
        if kind == RREF_CREATE:
            return function_name(obj[2])
    except (TypeError, IndexError, KeyError):
        pass  # not a payload of that kind: counted under the kind
    return kind_label(kind)


# function_name's answers for module-level functions and builtins, which live
# as long as their module anyway. Not lambdas or closures: a caller may make
# one per call, and each unpickled by value is a new object holding what it
# captured; the cache would keep them alive.
_names: dict[Any, str] = {}


def function_name(func: Any) -> str:
    """``module.qualname`` of a function (a builtin: ``module.name``, e.g. ``torch.add``)."""
    try:
        return _names[func]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    name = _function_name(func)
    if (
        isinstance(func, (types.FunctionType, types.BuiltinFunctionType))
        and "<" not in name  # <lambda>, <locals>
        and len(_names) < 4096
    ):
        _names[func] = name  # functions hash by identity and keep their names
    return name


def _function_name(func: Any) -> str:
    name: Any = func.__name__ if isinstance(func, types.BuiltinFunctionType) else None
    if name is None:
        name = getattr(func, "__qualname__", None)
        if not isinstance(name, str):
            name = type(func).__qualname__  # a callable object: its class
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) else name


# -- Prometheus ------------------------------------------------------------------
_COUNTERS = {
    "calls_sent": "calls this worker sent",
    "replies": "calls sent that were answered (a value or an error)",
    "errors": "calls sent that ended with an error (remote exception, lost peer, ...)",
    "timeouts": "calls sent that timed out",
    "calls_served": "requests this worker served",
    "errors_served": "requests served whose function raised",
    "bytes_sent": "bytes sent (requests and replies)",
    "bytes_received": "bytes received (requests and replies)",
    "tensor_bytes_sent": "tensor bytes sent",
    "tensor_bytes_received": "tensor bytes received",
}


class Exporter:
    """The Prometheus endpoint: prometheus-client's HTTP server on its own
    thread, reading the rows at each scrape (nothing is paid between scrapes).

    Series: ``rrpc_peer_<counter>_total{worker, peer}`` and
    ``rrpc_function_<counter>_total{worker, function}`` for every counter of a
    row, ``rrpc_{peer,function}_in_flight``, the latency histograms
    ``rrpc_{peer,function}_latency_seconds`` (buckets at each doubling from
    1 µs) and ``rrpc_worker_<gauge>{worker}`` for ``worker_gauges()``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        worker: str,
        metrics: Metrics,
        worker_gauges: Callable[[], dict[str, float]],
    ):
        try:
            import prometheus_client
        except ImportError as exc:
            raise RpcError(
                f"metrics_port={port} needs prometheus-client: pip install 'rrpc[metrics]'"
            ) from exc
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(_Collector(worker, metrics, worker_gauges))
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=host, registry=registry
            )
        except OSError as exc:
            raise RpcError(f"{worker}: cannot serve metrics on {host}:{port}: {exc}") from exc
        self.port = self._server.server_address[1]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


class _Collector:
    def __init__(self, worker: str, metrics: Metrics, worker_gauges: Callable[[], dict]):
        self._worker = worker
        self._metrics = metrics
        self._worker_gauges = worker_gauges

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        worker = self._worker
        for by, rows in (
            ("peer", list(self._metrics.peers.items())),
            ("function", list(self._metrics.functions.items())),
        ):
            labels = ["worker", by]
            for counter, doc in _COUNTERS.items():
                name, help_text = f"rrpc_{by}_{counter}", f"{doc}, by {by}"
                family = CounterMetricFamily(name, help_text, None, labels)
                for key, row in rows:
                    family.add_metric([worker, key], getattr(row, counter))
                yield family
            in_flight = GaugeMetricFamily(
                f"rrpc_{by}_in_flight", f"calls sent and not ended yet, by {by}", None, labels
            )
            latency = HistogramMetricFamily(
                f"rrpc_{by}_latency_seconds", f"time from send to reply, by {by}", labels=labels
            )
            for key, row in rows:
                in_flight.add_metric([worker, key], row.in_flight)
                buckets = [(repr(bound), float(count)) for bound, count in row.cumulative_buckets()]
                buckets.append(("+Inf", float(row.replies)))
                latency.add_metric([worker, key], buckets, row.latency_total)
            yield in_flight
            yield latency
        for name, value in self._worker_gauges().items():
            gauge = GaugeMetricFamily(
                f"rrpc_worker_{name}", f"{name} (rrpc.stats('worker'))", None, ["worker"]
            )
            gauge.add_metric([worker], value)
            yield gauge
