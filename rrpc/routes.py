"""The carriers to each peer: its same-host lane when it has one, else its gRPC stream.

Theory of operation. A call to a peer goes over the peer's lane when both
share this host and a lane is open or opens (``lane.py``), else over the one
gRPC stream this worker keeps to it (``transport.Connection``). Each is
opened at the first call that needs it and kept; one that ends is forgotten
(``closed``), so that the next call opens a new one (a lane that cannot
open sends its calls over gRPC for a while). The agent fails the calls that
were on it. ``stop`` ends them all.

Rules:
- A call is never held past its timeout by opening a carrier. A gRPC stream
  connects in the background (its calls wait in its outbox, under their
  deadlines); a lane opens in the caller's thread, in a handshake that a
  frozen peer's socket spends in full (its listen backlog accepts the
  connection, nobody answers). So the handshake is limited by the call's
  timeout (the call's time runs from before it: ``Agent._send``), a peer
  whose process is stopped or gone fails it at once (``lane.connect`` asks
  the kernel), and a suspect (``Agent.suspects``: its carrier broke, a lane
  to it could not open, or a barrier probes it) gets no new lane: its calls
  go over gRPC until it answers one, which clears the suspicion. A lane
  already open is used as it is (its writes never block).
- Every gRPC channel opened is closed explicitly, broken ones too: a channel
  left to the garbage collector can hang the interpreter's exit in gRPC's
  finalizer.
- A gRPC stream that fails with an error (its keepalive: the peer stopped
  answering) ends the peer's lane too.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from rrpc import auth, lane, transport
from rrpc.messages import PeerUnavailableError, RpcError, WorkerInfo

Carrier = Any  # a transport.Connection or a lane.Lane: send(pieces), stream, close()


class Routes:
    """The lanes and gRPC streams of one run, by peer rank. ``agent`` is the
    run's ``Agent``: its peers, options, scheduler, and where replies and
    ends go (``on_reply``, ``on_carrier_closed``)."""

    def __init__(self, agent: Any, channel_credentials: Any):
        self._agent = agent
        options = agent.options
        self._options = options
        self._credentials = channel_credentials
        self._metadata = [("rrpc-rank", str(agent.info.id))]
        self._connections: dict[int, transport.Connection] = {}
        self._lock = threading.Lock()
        self._opened: list[transport.Connection] = []  # every channel opened, closed at stop
        self._stopped = False
        self.lanes: lane.Lanes | None = None
        if options.same_host_lane:
            token = auth.Token(options.auth_token) if options.auth_token else None
            self.lanes = lane.Lanes(agent.info.id, token, self._new_lane, agent.suspects.add)

    def to(self, peer: WorkerInfo, timeout: float = 0.0) -> tuple[Carrier, lane.Lane | None]:
        """The carrier of a call to ``peer`` (opened if need be: a lane within
        the call's ``timeout``, 0 for none), and it again if it is a lane."""
        route = self._lane(peer, timeout)
        return (route, route) if route is not None else (self._connection(peer), None)

    def _connection(self, peer: WorkerInfo) -> transport.Connection:
        connection = self._connections.get(peer.id)
        if connection is not None:
            return connection
        with self._lock:
            connection = self._connections.get(peer.id)
            if connection is None:
                if self._stopped:
                    raise RpcError(f"rrpc on {self._agent.info.name} is shut down")
                entry = self._agent.peers.known(peer.id)
                address = entry.address if entry is not None else None
                if address is None:
                    raise PeerUnavailableError(
                        self._agent.peers.departed.get(
                            peer.id, f"{peer.name} is not a known worker"
                        )
                    )
                connection = transport.Connection(
                    address,
                    self._metadata,
                    on_frame=lambda frame: self._agent.on_reply(peer, frame),
                    on_close=lambda closed, error: self._agent.on_carrier_closed(
                        peer, closed, error
                    ),
                    packet_size=self._options.chunk_size,
                    max_message_size=self._options.max_message_size,
                    peer_name=peer.name,
                    scheduler=self._agent.scheduler,
                    credentials=self._credentials,
                    attach=functools.partial(self._agent.attach_from, peer.id),
                    peer_timeout=self._options.peer_timeout,
                    auth_token=self._options.auth_token,
                    ranks=(self._agent.info.id, peer.id),
                    # A bulk socket is not encrypted: none beside a TLS stream.
                    bulk_port=entry.bulk_port
                    if self._options.bulk_channel and self._credentials is None
                    else 0,
                    bulk_sockets=self._options.bulk_sockets,
                )
                self._connections[peer.id] = connection
                self._opened.append(connection)
        return connection

    def _lane(self, peer: WorkerInfo, timeout: float) -> lane.Lane | None:
        """The lane to ``peer``, if it shares this host and one is (or can be,
        within ``timeout``) open."""
        lanes = self.lanes
        if lanes is None:
            return None
        found = lanes.open.get(peer.id)
        if found is not None or peer.id in self._agent.suspects:
            return found  # a suspect may be frozen: opening would block (see the rules)
        entry = self._agent.peers.known(peer.id)
        if entry is None or not entry.lane_path:
            return None
        return lanes.to(peer, entry.lane_path, timeout)

    def lane_to(self, peer: WorkerInfo) -> lane.Lane | None:
        """The lane open to ``peer`` now, if any (for tests and stats)."""
        return self.lanes.open.get(peer.id) if self.lanes is not None else None

    def _new_lane(self, sock: Any, peer: WorkerInfo) -> lane.Lane:
        return lane.Lane(
            sock,
            peer.name,
            on_frame=functools.partial(self._agent.on_reply, peer),
            on_close=functools.partial(self._agent.on_carrier_closed, peer),
            reader=self._agent.frame_reader(peer.id),
            call_later=self._agent.scheduler.call_later,
            peer_timeout=self._options.peer_timeout,
            spin=self._options.lane_spin,
        )

    def closed(self, peer: WorkerInfo, carrier: Carrier, error: BaseException | None) -> None:
        """``carrier`` to ``peer`` ended: the next call opens another."""
        if isinstance(carrier, lane.Lane):
            if self.lanes is not None:
                self.lanes.forget(peer.id, carrier)
        else:
            if error is not None and self.lanes is not None:
                self.lanes.break_to(peer.id, error)  # keepalive: the peer stopped answering
            with self._lock:
                if self._connections.get(peer.id) is carrier:
                    del self._connections[peer.id]  # the next call reconnects (or fails fast)
                if carrier in self._opened:
                    self._opened.remove(carrier)
        carrier.release()

    def remove(self, peer_rank: int) -> None:
        """Close the gRPC stream to ``peer_rank`` (it left the group)."""
        with self._lock:
            connection = self._connections.pop(peer_rank, None)
        if connection is not None:
            connection.close()

    def stop(self, graceful: bool, deadline: float) -> None:
        """Close every lane and stream (gracefully: each by ``deadline``)."""
        with self._lock:
            self._stopped = True
            connections = list(self._connections.values())
            self._connections.clear()
            opened, self._opened = self._opened, []
        lanes = self.lanes.stop() if self.lanes is not None else []
        for connection in connections:
            if graceful:
                connection.close(max(0.0, deadline - time.monotonic()))
            else:
                connection.abort()
        for connection in opened:  # broken ones too: an open channel can hang exit
            connection.release()
        for opened_lane in lanes:
            opened_lane.close()
