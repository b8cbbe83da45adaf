"""Where a no-op rpc_sync's time goes: a per-hop profile of rrpc's round trip.

Run from the repository root: ``python benchmarks/hops.py [calls]``.

A client and a server process (spawned, loopback) make sequential no-op
``rpc_sync`` calls. Both stamp ``time.perf_counter_ns()`` (CLOCK_MONOTONIC: one
clock for every process on the host) at the entry or exit of a few of rrpc's
functions, wrapped in place for this run only; the stamps are merged by time and
cut into calls, and each hop's median is printed. Stamps cost ~1 µs each.

Hops, in order: the caller's ``send`` (encode, call table, queue the frame);
gRPC's request-iterator thread waking to pack it; the request's way to the
server (gRPC's send, the socket, gRPC's receive, a reader thread waking); the
server's handling (decode, run, encode the reply) up to cutting its packet,
which the same thread sends (over gRPC it waits there for gRPC to take it);
the reply's way back; decoding and completing the call; the caller waking.
The bare-grpcio floor (floor.py) has the same two ways and the same two
wake-ups at the ends, and none of the rest.
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

from rrpc.api import is_available as noop  # a module function: pickled by name

T = time.perf_counter_ns
WARMUP = 300


def patch(marks: list) -> None:
    """Stamp (tag, ns) into ``marks`` at the entry (``>``) or exit (``<``) of rrpc's hops."""
    from rrpc import agent, dispatch, futures, wire

    def stamp(owner, name, tag, at_exit=False):
        original = getattr(owner, name)

        def stamped(*args, **kwargs):
            if not at_exit:
                marks.append((tag, T()))
            result = original(*args, **kwargs)
            if at_exit:
                marks.append((tag, T()))
            return result

        setattr(owner, name, stamped)

    stamp(agent.Agent, "_send", "send>")
    stamp(agent.Agent, "_send", "send<", at_exit=True)
    stamp(agent.Agent, "on_reply", "on_reply>")
    stamp(dispatch.Dispatcher, "on_request", "on_request>")
    stamp(dispatch.Dispatcher, "on_request", "on_request<", at_exit=True)
    stamp(wire.FrameReader, "frames_in", "feed>")
    stamp(futures.SyncReply, "set_result", "set_result>")
    packets = wire.packets

    def stamped_packets(*args, **kwargs):  # a generator: stamped when it starts
        marks.append(("packets>", T()))
        yield from packets(*args, **kwargs)

    wire.packets = stamped_packets


def server(port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import rrpc

    marks = []
    patch(marks)
    rrpc.init_rpc("server", rank=1, world_size=2)
    rrpc.shutdown()
    json.dump(marks, open(out, "w"))


def client(port, calls, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import rrpc

    marks = []
    patch(marks)
    rrpc.init_rpc("client", rank=0, world_size=2)
    for _ in range(WARMUP):
        rrpc.rpc_sync("server", noop)
    marks.clear()
    for _ in range(calls):
        marks.append(("call>", T()))
        rrpc.rpc_sync("server", noop)
        marks.append(("call<", T()))
    m = list(marks)
    rrpc.shutdown()
    json.dump(m, open(out, "w"))


def profile(calls: int) -> list[tuple[str, str, float]]:
    """(from, to, median µs) for each hop of ``calls`` sequential no-op calls."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        client_out, server_out = os.path.join(tmp, "client"), os.path.join(tmp, "server")
        process = mp.get_context("spawn").Process(target=server, args=(port, server_out))
        process.start()
        try:
            client(port, calls, client_out)
        finally:
            process.join(30)
            if process.is_alive():
                process.kill()
        with open(client_out) as f:
            client_marks = json.load(f)
        with open(server_out) as f:
            server_marks = json.load(f)
    merged = sorted(
        [(t, "client:" + k) for k, t in client_marks]
        + [(t, "server:" + k) for k, t in server_marks]
    )
    cut: list[list[tuple[str, int]]] = []
    for t, k in merged:
        if k == "client:call>":
            cut.append([])
        if cut:
            cut[-1].append((k, t))
    shapes = collections.Counter(tuple(k for k, _ in c) for c in cut)
    shape, _ = shapes.most_common(1)[0]  # calls interleaved with stray stamps are left out
    chosen = [c for c in cut if tuple(k for k, _ in c) == shape]
    return [
        (shape[i - 1], shape[i], statistics.median((c[i][1] - c[i - 1][1]) / 1e3 for c in chosen))
        for i in range(1, len(shape))
    ]


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    hops = profile(calls)
    print(f"rrpc no-op rpc_sync, {calls} calls, median per hop (load {os.getloadavg()[0]:.1f}):")
    for start, end, micros in hops:
        print(f"  {start:<22} -> {end:<22} {micros:7.1f} µs")
    print(f"  {'sum of medians':<48} {sum(m for _, _, m in hops):7.1f} µs")


if __name__ == "__main__":
    main()
