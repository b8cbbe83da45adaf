"""The auth token, hostile bytes on a worker's port, and message size limits.

One world of three workers records what it saw:
- worker0 and worker1 share the token through ``RRPC_AUTH_TOKEN``;
  worker2 has the wrong one (option ``auth_token``);
- worker1 accepts messages of at most ``SMALL_LIMIT`` bytes;
- worker0 also opens raw gRPC streams to worker1's port and sends it frames
  built by hand: unauthenticated, with a replayed handshake, malformed, and a
  pickle that would create a marker file if it were ever loaded. Streams that
  should get through do the caller's side of the auth handshake by hand.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import struct
import threading
import time

import grpc
import pytest
import torch

import rrpc
from harness import mp_context, run_workers
from harness import outcome as _outcome
from rrpc import auth, codec, wire
from rrpc._proto.rrpc_pb2 import Envelope, SharedBuffer
from rrpc.messages import CALL, HANDSHAKE

TOKEN = "right-token"
SMALL_LIMIT = 1 << 20
METHOD = "/rrpc.Worker/Exchange"


def _whoami():
    return rrpc.get_worker_info().name


def _my_address():
    return rrpc.agent.current_agent().address


def _zeros(nbytes):
    return torch.zeros(nbytes, dtype=torch.uint8)


class _CreatesFile:
    """Unpickling this creates a file: proof that a payload was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- Raw gRPC streams ------------------------------------------------------------


def _raw_exchange(
    address, packets, metadata, replies_wanted=1, timeout=10.0, token=None, callee_rank=1, sent=None
):
    """Send `packets` on a fresh Exchange stream; return (frames received, grpc error or None).

    With `token`, first does the caller's side of the auth handshake with it:
    a nonce in the metadata, then, once the callee's handshake arrived, the
    proof as the first packet (the callee's proof is not checked: a hostile
    caller does not care). The callee's handshake is not among the frames
    returned. `sent`, a list, gets the metadata and every packet sent.

    The request side stays open until the wanted replies arrived (or the
    stream ended), so the server has time to answer.
    """
    outgoing: queue.SimpleQueue = queue.SimpleQueue()
    nonce = auth.new_nonce()
    if token is None:
        for packet in packets:
            outgoing.put(packet)
    else:
        metadata = [*metadata, (auth.NONCE_KEY, nonce.hex())]
    if sent is not None:
        sent.append(metadata)
    finished = threading.Event()

    def requests():
        while True:
            try:
                packet = outgoing.get(timeout=0.05)
            except queue.Empty:
                if finished.is_set():
                    return
                continue
            if sent is not None:
                sent.append(packet)
            yield packet

    def prove(handshake):
        caller_rank = int(dict(metadata).get("rrpc-rank", "-1"))
        binding = auth.Binding(caller_rank, callee_rank, address, nonce, handshake.nonce)
        proof = auth.Token(token).proof(auth.CALLER, binding)
        outgoing.put(auth.handshake_frame(b"", proof))
        for packet in packets:
            outgoing.put(packet)

    frames, error = [], None
    reader = wire.FrameReader()
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(METHOD)(requests(), metadata=metadata, timeout=timeout)
        try:
            for packet in call:
                for frame in reader.feed(packet):
                    if frame.envelope.kind != HANDSHAKE:
                        frames.append(frame)
                    elif token is not None:
                        prove(frame.envelope.handshake)
                if len(frames) >= replies_wanted:
                    break
        except grpc.RpcError as exc:
            error = {"code": exc.code().name, "details": exc.details()}
        finally:
            finished.set()
            call.cancel()
    return frames, error


def _frame(kind, request_id, payload: bytes, buffers=(), envelope_bytes=None):
    envelope = Envelope(
        kind=kind,
        request_id=request_id,
        payload_size=len(payload),
        buffer_sizes=[len(b) for b in buffers],
    )
    head = envelope.SerializeToString() if envelope_bytes is None else envelope_bytes
    return struct.pack("<I", len(head)) + head + payload + b"".join(buffers)


def _encoded_call(func, args, request_id=1):
    return b"".join(bytes(p) for p in codec.encode(CALL, request_id, (func, args, {})).pieces)


def _decoded_error(frame):
    """An ERROR reply's (type name, message)."""
    _blob, type_name, message, _text, _where = codec.loads(frame)
    return type_name, message


_TOKEN_CASES = ("none", "in plain metadata", "nonce only", "wrong", "replayed", "right")


def _hostile_bytes(address, marker_dir):
    seen = {}
    markers = {name: os.path.join(marker_dir, name) for name in _TOKEN_CASES}
    rank = [("rrpc-rank", "0")]
    recorded: list = []  # a real exchange, for the replay
    nonce_only = [(auth.NONCE_KEY, auth.new_nonce().hex())]
    for name, metadata, token in (
        ("none", rank, None),
        ("in plain metadata", rank + [("rrpc-token", TOKEN)], None),  # how tokens used to travel
        ("nonce only", rank + nonce_only, None),  # a request where the caller's proof belongs
        ("wrong", rank, "wrong-token"),
        ("right", rank, TOKEN),
    ):
        packet = _encoded_call(_whoami, (_CreatesFile(markers[name]),))
        sent = recorded if name == "right" else None
        frames, error = _raw_exchange(address, [packet], metadata, token=token, sent=sent)
        seen[f"token {name}"] = {
            "error": error,
            "replies": [f.envelope.kind for f in frames],
            "marker exists": os.path.exists(markers[name]),
        }
    # The right exchange's metadata and proof, sent again on a new stream.
    recorded_metadata, recorded_proof = recorded[0], recorded[1]
    packet = _encoded_call(_whoami, (_CreatesFile(markers["replayed"]),))
    frames, error = _raw_exchange(address, [recorded_proof, packet], recorded_metadata)
    seen["token replayed"] = {
        "error": error,
        "replies": [f.envelope.kind for f in frames],
        "marker exists": os.path.exists(markers["replayed"]),
        "recorded": [recorded_metadata, recorded_proof],
    }

    for name, claimed in (("rank past int64", str(1 << 64)), ("rank not a number", "x")):
        frames, error = _raw_exchange(address, [], [("rrpc-rank", claimed)], token=TOKEN)
        seen[name] = {"error": error, "replies": len(frames)}

    authorized = {"metadata": rank, "token": TOKEN}
    malformed = {
        "absurd envelope size": struct.pack("<I", 0x7FFFFFF0) + b"\0" * 64,
        "unparseable envelope": _frame(CALL, 1, b"", envelope_bytes=b"\xff" * 12),
    }
    for name, packet in malformed.items():
        frames, error = _raw_exchange(address, [packet], **authorized)
        seen[name] = {"error": error, "replies": len(frames)}
        seen[f"after {name}"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)

    # Well-formed frames with bad contents get an ERROR reply on a stream that stays usable.
    frames, error = _raw_exchange(
        address,
        [
            _frame(CALL, 5, b"\x80\x05not a pickle"),
            _frame(77, 6, b"\x80\x05N."),  # kind 77 does not exist; payload None
            _encoded_call(_whoami, (), request_id=7),
        ],
        **authorized,
        replies_wanted=3,
    )
    seen["bad contents"] = {
        "error": error,
        "replies": {
            f.envelope.request_id: (
                codec.loads(f) if f.envelope.kind == rrpc.messages.REPLY else _decoded_error(f)
            )
            for f in frames
        },
    }

    # A frame that stops half way, then the caller goes away.
    truncated = _frame(CALL, 8, b"\x80\x05" + b"x" * 100)[:40]
    frames, error = _raw_exchange(address, [truncated], **authorized, timeout=0.5)
    seen["truncated"] = {"error": error, "replies": len(frames)}
    seen["after truncated"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
    return seen


def _other_local_address():
    """A non-loopback address of this host, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _listens_elsewhere(address):
    other = _other_local_address()
    if other is None:
        return None
    port = int(address.rsplit(":", 1)[1])
    try:
        with socket.create_connection((other, port), timeout=2):
            return True
    except OSError:
        return False


# -- The world -----------------------------------------------------------------


def _security_world(rank, world_size, marker_dir, in_shutdown):
    options = {
        0: rrpc.RpcBackendOptions(),
        1: rrpc.RpcBackendOptions(max_message_size=SMALL_LIMIT),
        2: rrpc.RpcBackendOptions(auth_token="wrong-token"),
    }[rank]
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = {"token from env": options.auth_token}
    if rank == 2:
        seen["to worker1"] = [
            _outcome(rrpc.rpc_sync, "worker1", _whoami, timeout=10) for _ in range(20)
        ]
    elif rank == 1:
        seen["too large to send"] = _outcome(
            rrpc.rpc_sync, "worker0", torch.numel, args=(_zeros(SMALL_LIMIT + 1),)
        )
        seen["after too large to send"] = _outcome(rrpc.rpc_sync, "worker0", _whoami)
        in_shutdown.set()  # worker1 waits in the shutdown barrier until worker0 is done
    else:
        seen["to worker1"] = _outcome(rrpc.rpc_sync, "worker1", _whoami, timeout=10)
        seen["to worker2"] = [
            _outcome(rrpc.rpc_sync, "worker2", _whoami, timeout=10) for _ in range(20)
        ]
        address = rrpc.rpc_sync("worker1", _my_address)
        seen["address"] = address
        seen["listens elsewhere"] = _listens_elsewhere(address)
        seen.update(_hostile_bytes(address, marker_dir))
        seen["too large for receiver"] = _outcome(
            rrpc.rpc_sync, "worker1", torch.numel, args=(_zeros(SMALL_LIMIT + 1),), timeout=10
        )
        seen["after too large for receiver"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
        seen["reply too large"] = _outcome(
            rrpc.rpc_sync, "worker1", _zeros, args=(SMALL_LIMIT + 1,), timeout=10
        )
        seen["after reply too large"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
        assert in_shutdown.wait(30)
        start = time.monotonic()
        frames, error = _raw_exchange(
            address,
            [_encoded_call(_whoami, ())],
            [("rrpc-rank", "99")],
            token=TOKEN,
        )
        seen["stranger during shutdown barrier"] = {
            "replies": [codec.loads(f) for f in frames],
            "error": error,
            "elapsed": time.monotonic() - start,
        }
    rrpc.shutdown()
    return seen


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    marker_dir = str(tmp_path_factory.mktemp("markers"))
    results = run_workers(
        _security_world,
        3,
        args=(marker_dir, mp_context.Event()),
        env={"RRPC_AUTH_TOKEN": TOKEN},
        init=False,
        timeout=90,
    )
    return results


# -- Tokens --------------------------------------------------------------------


def test_token_comes_from_the_environment_and_the_right_token_works(world):
    assert world[0]["token from env"] == TOKEN
    assert world[1]["token from env"] == TOKEN
    assert world[0]["to worker1"]["value"] == "worker1"


def test_worker_with_the_wrong_token_gets_authentication_error_naming_the_peer(world):
    for seen in world[2]["to worker1"]:  # every time, not only on the first connection
        assert seen["type"] == "AuthenticationError", seen
        assert "worker1" in seen["message"]
        assert "token" in seen["message"]
        assert seen["elapsed"] < 5.0  # rejected, not timed out


def test_worker_rejects_callers_whose_token_does_not_match_its_own(world):
    for seen in world[0]["to worker2"]:
        assert seen["type"] == "AuthenticationError", seen
        assert "worker2" in seen["message"]


@pytest.mark.parametrize("token", [case for case in _TOKEN_CASES if case != "right"])
def test_request_without_the_right_token_is_refused_before_its_payload_is_unpickled(world, token):
    # Also the token itself in plain metadata (as it travelled before the
    # handshake), and the metadata and proof of a real exchange replayed.
    seen = world[0][f"token {token}"]
    assert seen["error"] == {"code": "UNAUTHENTICATED", "details": "wrong or missing auth token"}
    assert seen["replies"] == []
    assert seen["marker exists"] is False


def test_the_recorded_exchange_holds_no_trace_of_the_token(world):
    metadata, proof = world[0]["token replayed"]["recorded"]
    recorded = repr(metadata).encode() + proof
    assert TOKEN.encode() not in recorded
    assert TOKEN.encode().hex().encode() not in recorded


def test_the_marker_payload_does_create_its_file_when_the_token_is_right(world):
    # The control for the test above: the same bytes, authenticated, are loaded.
    seen = world[0]["token right"]
    assert seen["marker exists"] is True
    assert seen["error"] is None
    assert seen["replies"] == [rrpc.messages.ERROR]  # an open file is not a str for _whoami


def test_server_listens_on_the_advertised_host_only(world):
    assert world[0]["address"].startswith("127.0.0.1:")
    assert world[0]["listens elsewhere"] in (False, None)


# -- Malformed frames ----------------------------------------------------------


def test_absurd_envelope_size_ends_that_stream_with_a_clear_error(world):
    seen = world[0]["absurd envelope size"]
    assert seen["replies"] == 0
    assert seen["error"]["code"] == "INVALID_ARGUMENT"
    assert "malformed frame" in seen["error"]["details"]
    assert str(0x7FFFFFF0) in seen["error"]["details"]


@pytest.mark.parametrize("name", ["rank past int64", "rank not a number"])
def test_a_caller_naming_no_rank_is_refused_with_a_clear_error(world, name):
    seen = world[0][name]
    assert seen["replies"] == 0
    assert seen["error"] == {"code": "INVALID_ARGUMENT", "details": "rrpc-rank is not a rank"}


def test_unparseable_envelope_ends_that_stream_with_a_clear_error(world):
    seen = world[0]["unparseable envelope"]
    assert seen["error"]["code"] == "INVALID_ARGUMENT"
    assert "unparseable envelope" in seen["error"]["details"]


def test_well_formed_frames_with_bad_contents_get_error_replies_and_the_stream_goes_on(world):
    seen = world[0]["bad contents"]
    assert seen["error"] is None
    replies = seen["replies"]
    assert set(replies) == {5, 6, 7}
    assert replies[5][0] == "rrpc.messages.SerializationError"
    assert replies[6] == ("rrpc.messages.RpcError", "worker1 has no handler for unknown kind 77")
    assert replies[7] == "worker1"


def test_truncated_frame_does_not_hang_the_server(world):
    assert world[0]["truncated"]["replies"] == 0
    assert world[0]["after truncated"]["value"] == "worker1"


def test_request_from_an_unknown_rank_is_answered_promptly_while_the_callee_is_in_shutdown(
    world,
):
    seen = world[0]["stranger during shutdown barrier"]
    assert seen["error"] is None
    assert seen["replies"] == ["worker1"]
    assert seen["elapsed"] < 1.0


def test_server_keeps_serving_other_callers_after_malformed_frames(world):
    for name in ("absurd envelope size", "unparseable envelope"):
        assert world[0][f"after {name}"]["value"] == "worker1"


# -- Message size limits -------------------------------------------------------


def _assert_names_both_sizes(message):
    assert str(SMALL_LIMIT) in message, message
    sizes = [int(word) for word in message.replace("=", " ").split() if word.isdigit()]
    assert any(size > SMALL_LIMIT for size in sizes), message


def test_message_over_the_senders_limit_is_refused_with_both_sizes_then_calls_work(world):
    seen = world[1]["too large to send"]
    assert seen["type"] == "MessageTooLargeError"
    _assert_names_both_sizes(seen["message"])
    assert seen["elapsed"] < 1.0
    assert world[1]["after too large to send"]["value"] == "worker0"


def test_message_over_the_receivers_limit_is_refused_with_both_sizes_then_calls_work(world):
    seen = world[0]["too large for receiver"]
    assert "type" in seen, seen
    assert seen["type"] in ("MessageTooLargeError", "PeerUnavailableError")
    _assert_names_both_sizes(seen["message"])
    assert world[0]["after too large for receiver"]["value"] == "worker1"


def test_reply_over_the_callees_limit_is_refused_with_both_sizes(world):
    seen = world[0]["reply too large"]
    assert seen["type"] == "MessageTooLargeError"
    _assert_names_both_sizes(seen["message"])
    assert world[0]["after reply too large"]["value"] == "worker1"


# -- Shared-memory descriptors from the wire --------------------------------------


def _shared_buffer_frame(segment):
    """A CALL whose one tensor buffer claims to be in shared memory at ``segment``."""
    payload = pickle.dumps((_whoami, (), {}))
    envelope = Envelope(kind=CALL, request_id=7, payload_size=len(payload), buffer_sizes=[0])
    envelope.shared_buffers[0].CopyFrom(SharedBuffer(segment=segment, offset=64, size=16))
    head = envelope.SerializeToString()
    return struct.pack("<I", len(head)) + head + payload


def _attack_with_descriptors(rank, world_size, victim, victim_size):
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    seen = None
    if rank == 0:
        address = rrpc.rpc_sync("worker1", _my_address)
        seen = {}
        # Claiming to be worker0 (a real same-host peer): another process's open
        # file, worker0's own stdin, and a segment number in no pool at all.
        for name, segment in (
            ("victim's file", victim),
            ("worker0's stdin", f"{os.getpid()}/0"),
            ("no such fd", f"{os.getpid()}/999999"),
        ):
            frames, error = _raw_exchange(
                address, [_shared_buffer_frame(segment)], [("rrpc-rank", "0")]
            )
            seen[name] = {"replies": len(frames), "error": error}
        seen["still serving"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
        big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: the real shm path
        seen["real shared memory"] = torch.equal(rrpc.rpc_sync("worker1", torch.clone, (big,)), big)
    rrpc.shutdown()
    return seen


def test_a_shared_memory_descriptor_outside_the_peers_pool_is_refused_and_maps_nothing(tmp_path):
    # The worker used to map /proc/<pid>/fd/<fd> of any process a frame named,
    # read-write, before unpickling anything.
    victim_path = tmp_path / "victim"
    content = b"V" * 64 + b"victim-bytes-16b" + b"tail"
    victim_path.write_bytes(content)
    fd = os.open(victim_path, os.O_RDWR)
    try:
        seen = run_workers(
            _attack_with_descriptors,
            2,
            args=(f"{os.getpid()}/{fd}", len(content)),
            env={"RRPC_SHM": "1"},
            init=False,
            timeout=60,
        )[0]
    finally:
        os.close(fd)
    for name in ("victim's file", "worker0's stdin", "no such fd"):
        assert seen[name]["replies"] == 0, seen
        assert seen[name]["error"]["code"] == "INVALID_ARGUMENT", seen
    assert "not in the pool of the peer on this stream" in seen["victim's file"]["error"]["details"]
    assert victim_path.read_bytes() == content
    assert seen["still serving"]["value"] == "worker1"
    assert seen["real shared memory"] is True


# -- A caller that half-closes its side ------------------------------------------


def _stream_readers(caller_rank):
    """The threads reading requests from ``caller_rank``'s streams: two per
    stream while it is read, one fewer once it read the caller's half-close."""
    prefix = f"rrpc-serve-{caller_rank}-"
    return sum(thread.name.startswith(prefix) for thread in threading.enumerate())


def _echo_once_half_closed(value, readers_while_open):
    # Still running when this worker reads the caller's half-close: wait for it
    # (a reader of the stream ends), whatever the machine's load.
    deadline = time.monotonic() + 30
    while _stream_readers(0) >= readers_while_open:
        if time.monotonic() > deadline:
            raise AssertionError("the callee never read the caller's half-close")
        time.sleep(0.01)  # polling a condition with a deadline
    return value


def _half_closed_exchange(address, packets, timeout=10.0):
    """Send `packets`, close the request side at once, and read every reply."""
    reader, frames = wire.FrameReader(), []
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(METHOD)(
            iter(packets), metadata=[("rrpc-rank", "0")], timeout=timeout
        )
        for packet in call:
            frames += reader.feed(packet)
    return frames


def _half_close_while_requests_run(rank, world_size):
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    replies = None
    if rank == 0:
        address = rrpc.rpc_sync("worker1", _my_address)
        open_readers = rrpc.rpc_sync("worker1", _stream_readers, args=(0,)) + 2  # and the new one
        calls = [
            _encoded_call(_echo_once_half_closed, (i, open_readers), request_id=i + 1)
            for i in range(3)
        ]
        frames = _half_closed_exchange(address, [b"".join(calls)], timeout=60)
        replies = sorted(codec.loads(frame) for frame in frames)
    rrpc.shutdown()
    return replies


def test_a_caller_that_half_closes_still_gets_every_reply():
    # The stream used to end, OK and empty, as soon as the request side closed.
    assert run_workers(_half_close_while_requests_run, 2, init=False, timeout=60)[0] == [0, 1, 2]
