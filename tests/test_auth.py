"""The auth handshake against an impostor: a process that registers a worker's
name in the rendezvous store with its own address.

The impostor needs nothing but TCP access to the store (MASTER_ADDR:MASTER_PORT):
it appends to the group's log a "joined" record of worker1 (a dynamic member)
with the address of a raw gRPC server of its own, which records every byte and
every metadata entry it receives and answers with pickles that would create a
marker file. worker0 reads the group (as any member may, at any time) and then
calls "worker1".
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import shutil
import socket
import struct
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import pytest
import torch.distributed as dist
from test_tls import make_certificates

import rrpc
from harness import mp_context, run_workers
from rrpc import auth, wire
from rrpc._proto.rrpc_pb2 import Envelope
from rrpc.messages import HANDSHAKE, REPLY, AuthenticationError, ProtocolError

TOKEN = "the-cluster-token"
METHOD = "/rrpc.Worker/Exchange"
PREFIX = "rrpc/group/default/"  # the dynamic group's keys (rrpc/membership.py)
# What the impostor does on each stream that opens with an auth nonce, in order.
MODES = ("no handshake", "forged handshake", "relay to the real worker1", "silent")


def _whoami():
    return rrpc.get_worker_info().name


class _CreatesFile:
    """Unpickling this creates a file: proof that a payload was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _malicious_replies(marker):
    """REPLY frames for the first request ids, each a pickle that creates `marker`."""
    payload = pickle.dumps(_CreatesFile(marker), protocol=5)
    frames = []
    for request_id in range(1, 21):
        head = Envelope(kind=REPLY, request_id=request_id, payload_size=len(payload))
        head_bytes = head.SerializeToString()
        frames.append(struct.pack("<I", len(head_bytes)) + head_bytes + payload)
    return b"".join(frames)


# -- The impostor ------------------------------------------------------------------


class _Impostor:
    """A raw gRPC server that records what it receives, and answers as ``MODES`` say."""

    def __init__(self, marker, control_marker, credentials=None):
        self.records = []
        self.real_address = None
        self._malicious = _malicious_replies(marker)
        self._control = _malicious_replies(control_marker)
        self._modes = iter(MODES)
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handler = grpc.stream_stream_rpc_method_handler(self._exchange)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("rrpc.Worker", {"Exchange": handler}),)
        )
        if credentials is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            port = self._server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def _exchange(self, request_iterator, context):
        metadata = [(key, value) for key, value in context.invocation_metadata()]
        record = {"metadata": metadata, "received": b"", "relayed": 0}
        with self._lock:
            self.records.append(record)
            asks_proof = any(key == auth.NONCE_KEY for key, _ in metadata)
            record["mode"] = next(self._modes, "silent") if asks_proof else "no handshake"
        if record["mode"] == "relay to the real worker1":
            yield from self._relay(request_iterator, metadata, record)
            return
        drained = threading.Event()
        threading.Thread(
            target=self._drain, args=(request_iterator, record, drained), daemon=True
        ).start()
        if not asks_proof:
            yield self._control
        elif record["mode"] == "no handshake":
            yield self._malicious
        elif record["mode"] == "forged handshake":
            yield auth.handshake_frame(os.urandom(32), os.urandom(32)) + self._malicious
        drained.wait(60)  # until the caller goes away

    @staticmethod
    def _drain(request_iterator, record, drained):
        try:
            for packet in request_iterator:
                record["received"] += packet
        except Exception:
            pass
        drained.set()

    def _relay(self, request_iterator, metadata, record):
        """Pass the caller's stream on to the real worker1, and its answers back."""

        def upstream_requests():
            for packet in request_iterator:
                record["received"] += packet
                yield packet

        forwarded = [(key, value) for key, value in metadata if key.startswith("rrpc-")]
        with grpc.insecure_channel(self.real_address) as channel:
            call = channel.stream_stream(METHOD)(upstream_requests(), metadata=forwarded)
            try:
                for packet in call:
                    record["relayed"] += 1
                    yield packet
            except grpc.RpcError as exc:
                record["upstream"] = exc.code().name

    def register_as_worker1(self, port):
        """Append a "joined" record of worker1 at this server's address to the group's log."""
        store = dist.TCPStore(
            "127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=30)
        )
        count = store.add(f"{PREFIX}events", 0)
        records = [json.loads(store.get(f"{PREFIX}event/{i}")) for i in range(1, count + 1)]
        [real] = [r for r in records if r["name"] == "worker1" and r["kind"] == "joined"]
        self.real_address = real["address"]
        forged = {**real, "incarnation": real["incarnation"] + 1, "address": self.address}
        forged["advertised"] = {}
        store.set(f"{PREFIX}event/{store.add(f'{PREFIX}events', 1)}", json.dumps(forged))
        del store

    def stop(self):
        self._server.stop(1).wait(5)


# -- The world ---------------------------------------------------------------------


def _world(rank, world_size, events, marker_dir, rogue_tls):
    worker0_in, worker1_in, impostor_ready, calls_done, control_done, left1, left3 = events
    del os.environ["WORLD_SIZE"]  # without it, membership is dynamic
    marker = os.path.join(marker_dir, "unpickled-by-a-worker-with-the-token")
    control_marker = os.path.join(marker_dir, "unpickled-by-the-control")
    if rank == 2:  # the impostor: no rrpc, no token
        assert worker1_in.wait(90)
        credentials = None
        if rogue_tls is not None:
            files = [open(rogue_tls[name], "rb").read() for name in ("key", "cert")]
            credentials = grpc.ssl_server_credentials([tuple(files)])
        impostor = _Impostor(marker, control_marker, credentials)
        impostor.register_as_worker1(int(os.environ["MASTER_PORT"]))
        impostor_ready.set()
        assert calls_done.wait(120) and control_done.wait(120)
        impostor.stop()
        return {"records": impostor.records, "real address": impostor.real_address}
    token = None if rank == 3 else TOKEN  # worker3: the control, without a token
    options = rrpc.RpcBackendOptions(auth_token=token, peer_timeout=2.0)
    if rank == 1:
        assert worker0_in.wait(90)  # so that worker0 has not learnt worker1's address
    if rank == 3:
        assert impostor_ready.wait(90)
    rrpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=options)
    seen = None
    if rank == 0:
        worker0_in.set()
        assert impostor_ready.wait(90)
        rrpc.get_worker_infos()  # reads the group's log, the forged record with it
        calls = 1 if rogue_tls is not None else len(MODES)
        seen = []
        for _ in range(calls):
            start = time.monotonic()
            try:
                rrpc.rpc_sync("worker1", _whoami, timeout=30)
                seen.append({"type": None})
            except Exception as exc:
                seen.append({"type": type(exc).__name__, "message": str(exc)})
            seen[-1]["elapsed"] = time.monotonic() - start
            seen[-1]["marker exists"] = os.path.exists(marker)
        calls_done.set()
        assert left1.wait(90) and left3.wait(90)  # the store's host leaves last
    elif rank == 1:
        worker1_in.set()
        assert calls_done.wait(120) and control_done.wait(120)
    else:  # the control: without a token, the impostor's reply is unpickled
        try:
            rrpc.rpc_sync("worker1", _whoami, timeout=30)  # returns an open file
        except Exception:
            pass
        seen = {"marker exists": os.path.exists(control_marker)}
        control_done.set()
    rrpc.shutdown()
    (left1 if rank == 1 else left3).set()
    return seen


def _run(tmp_path, rogue_tls=None, env=None):
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    events = [mp_context.Event() for _ in range(7)]
    world_size = 3 if rogue_tls is not None else 4
    if world_size == 3:  # no control worker3
        events[4].set()
        events[6].set()
    results = run_workers(
        _world,
        world_size,
        args=(events, str(marker_dir), rogue_tls),
        env=env,
        init=False,
        timeout=150,
    )
    return results, marker_dir


def _assert_no_trace_of_the_token(records):
    secret = TOKEN.encode()
    forms = (secret, secret.hex().encode(), base64.b64encode(secret), secret.upper())
    for record in records:
        texts = [record["received"]] + [
            (value if isinstance(value, bytes) else value.encode())
            for _, value in record["metadata"]
        ]
        for text, form in itertools.product(texts, forms):
            assert form not in text, record
        assert "rrpc-token" not in dict(record["metadata"])


@pytest.fixture(scope="module")
def impostor_world(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("impostor"))


def test_the_control_without_a_token_does_unpickle_the_impostors_reply(impostor_world):
    # What the attack did before the handshake: the impostor's pickle runs.
    (_, _, _, control), _ = impostor_world
    assert control == {"marker exists": True}


@pytest.mark.parametrize("mode", MODES)
def test_a_caller_refuses_an_impostor_with_an_authentication_error_naming_the_peer(
    impostor_world, mode
):
    (seen, _, _, _), marker_dir = impostor_world
    outcome = seen[MODES.index(mode)]
    assert outcome["type"] == "AuthenticationError", outcome
    assert "worker1" in outcome["message"]
    assert outcome["marker exists"] is False
    expected = {
        "no handshake": "did not authenticate (a frame of kind 1",
        "forged handshake": "failed to prove it knows the auth token",
        "relay to the real worker1": "failed to prove it knows the auth token",
        "silent": "did not authenticate within 2 s",
    }[mode]
    assert expected in outcome["message"]
    if mode == "silent":
        assert 2.0 <= outcome["elapsed"] < 8.0
    else:
        assert outcome["elapsed"] < 5.0  # refused, not timed out


def test_the_impostor_never_sees_the_token_nor_any_proof(impostor_world):
    (_, _, impostor, _), _ = impostor_world
    records = impostor["records"]
    assert sorted(record["mode"] for record in records) == sorted(MODES + ("no handshake",))
    _assert_no_trace_of_the_token(records)
    for record in records:
        if auth.NONCE_KEY in dict(record["metadata"]):
            # The callers with the token sent nothing on the request side: no proof, no request.
            assert record["received"] == b"", record


def test_a_relayed_proof_of_the_real_worker_is_refused(impostor_world):
    # The real worker1 proves itself for its own address, not the impostor's.
    (_, _, impostor, _), _ = impostor_world
    [relay] = [r for r in impostor["records"] if r["mode"] == "relay to the real worker1"]
    assert relay["relayed"] == 1  # worker1's genuine handshake went to the caller


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_with_mutual_tls_an_impostor_without_a_certificate_of_the_ca_fails_the_tls_handshake(
    tmp_path,
):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "rogue").mkdir()
    cluster = make_certificates(tmp_path / "cluster")
    rogue = make_certificates(tmp_path / "rogue")  # same names, another CA
    env = {"RRPC_TLS_CERT": cluster["cert"], "RRPC_TLS_KEY": cluster["key"]}
    env["RRPC_TLS_CA"] = cluster["ca"]
    ([outcome], _, impostor), _ = _run(tmp_path, rogue_tls=rogue, env=env)
    assert outcome["type"] == "PeerUnavailableError", outcome
    assert "worker1" in outcome["message"]
    assert outcome["marker exists"] is False
    assert impostor["records"] == []  # no stream ever reached it: not even the nonce


# -- A token on one side only ------------------------------------------------------


def _one_token(rank, world_size):
    options = rrpc.RpcBackendOptions(auth_token=TOKEN if rank == 0 else None)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        rrpc.rpc_sync(f"worker{1 - rank}", _whoami, timeout=10)
        seen = {"type": None}
    except Exception as exc:
        seen = {"type": type(exc).__name__, "message": str(exc)}
    rrpc.shutdown()
    return seen


def test_workers_of_which_only_one_has_a_token_refuse_each_other_clearly():
    with_token, without = run_workers(_one_token, 2, init=False, timeout=60)
    assert with_token["type"] == "AuthenticationError", with_token
    assert "worker1 rejected this worker: the callee has no auth token" in with_token["message"]
    assert without["type"] == "AuthenticationError", without
    assert "worker0 rejected this worker: wrong or missing auth token" in without["message"]


# -- The pieces --------------------------------------------------------------------


def _binding(**changes):
    fields = dict(
        caller_rank=0,
        callee_rank=1,
        callee_address="127.0.0.1:5000",
        caller_nonce=b"c" * auth.NONCE_SIZE,
        callee_nonce=b"s" * auth.NONCE_SIZE,
    )
    return auth.Binding(**{**fields, **changes})


def test_a_proof_covers_role_ranks_nonces_and_address_and_hides_the_token():
    token = auth.Token(TOKEN)
    proof = token.proof(auth.CALLER, _binding())
    assert len(proof) == auth.PROOF_SIZE
    assert token.verify(auth.CALLER, _binding(), proof)
    assert not token.verify(auth.CALLEE, _binding(), proof)  # no reflection
    for change in (
        {"caller_rank": 2},
        {"callee_rank": 2},
        {"callee_address": "127.0.0.1:5001"},
        {"caller_nonce": b"x" * auth.NONCE_SIZE},
        {"callee_nonce": b"x" * auth.NONCE_SIZE},
    ):
        assert not token.verify(auth.CALLER, _binding(**change), proof), change
    assert not auth.Token("another").verify(auth.CALLER, _binding(), proof)
    assert TOKEN not in repr(token)
    assert auth.new_nonce() != auth.new_nonce()
    with pytest.raises(ValueError):
        _binding(caller_nonce=b"short")


def _frame_of(envelope):
    head = envelope.SerializeToString()
    return struct.pack("<I", len(head)) + head


def test_a_handshake_frame_is_read_strictly():
    frame = auth.handshake_frame(b"n" * 32, b"p" * 32)
    handshake, rest = auth.read_handshake(frame + b"next frames")
    assert (handshake.nonce, handshake.proof, rest) == (b"n" * 32, b"p" * 32, b"next frames")
    assert wire.FrameReader().feed(frame)[0].envelope.kind == HANDSHAKE
    not_handshakes = {
        "empty": b"",
        "a request": _malicious_replies("/nonexistent")[:200],
        "cut short": frame[:-3],
        "huge envelope": struct.pack("<I", 1 << 30) + b"\0" * 8,
        "with a payload": _frame_of(Envelope(kind=HANDSHAKE, payload_size=9)) + b"x" * 9,
    }
    for name, packet in not_handshakes.items():
        with pytest.raises(ProtocolError):
            auth.read_handshake(packet)
            pytest.fail(f"{name} was taken for a handshake")


def _handshakes(caller_token=TOKEN, callee_token=TOKEN, dialled="127.0.0.1:5000"):
    """Both ends of one stream's handshake, the callee at 127.0.0.1:5000."""
    caller = auth.CallerHandshake(auth.Token(caller_token), (0, 1), dialled, "worker1")
    callee = auth.CalleeHandshake(
        auth.Token(callee_token), 0, 1, "127.0.0.1:5000", caller.nonce.hex()
    )
    return caller, callee


def test_both_ends_of_a_handshake_run_on_bytes_alone():
    caller, callee = _handshakes()
    assert caller.proof is None  # nothing to send before the callee proved itself
    assert caller.check(callee.frame + b"first reply") == b"first reply"
    assert caller.proof is not None
    assert callee.check(caller.proof + b"first request") == b"first request"


def test_a_callee_refuses_a_caller_without_the_token_and_says_why_in_its_log_only():
    caller, callee = _handshakes(caller_token="another")
    with pytest.raises(AuthenticationError):  # the caller sees the callee's proof fail
        caller.check(callee.frame)
    forged = auth.handshake_frame(b"", auth.Token("another").proof(auth.CALLER, _binding()))
    with pytest.raises(auth.Refused) as refused:
        callee.check(forged)
    assert refused.value.kind == "refused:proof"
    assert str(refused.value) == f"{auth.REFUSED} (wrong auth proof: it does not know the token)"
    with pytest.raises(auth.Refused, match="no auth handshake") as refused:
        callee.check(b"")
    assert refused.value.kind == "refused:proof"


def test_a_callee_refuses_a_caller_whose_metadata_has_no_valid_nonce():
    for nonce in ("", "zz", "ab" * (auth.NONCE_SIZE - 1)):
        with pytest.raises(auth.Refused) as refused:
            auth.CalleeHandshake(auth.Token(TOKEN), 0, 1, "127.0.0.1:5000", nonce)
        assert refused.value.kind == "refused:nonce"


def test_a_caller_refuses_a_callee_that_answers_for_another_address():
    caller, callee = _handshakes(dialled="127.0.0.1:6000")
    with pytest.raises(AuthenticationError, match="failed to prove it knows the auth token"):
        caller.check(callee.frame)
    assert caller.proof is None
    with pytest.raises(AuthenticationError, match="ended the stream before it authenticated"):
        caller.check(None)


def test_a_lane_or_bulk_callee_gives_a_caller_one_limit_for_the_whole_opening(monkeypatch):
    # A caller that sends its hello late and then never proves itself holds
    # the callee's thread for HANDSHAKE_TIMEOUT in all, not that much again
    # after its hello.
    from rrpc import lane_io

    monkeypatch.setattr(lane_io, "HANDSHAKE_TIMEOUT", 1.0)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    hello = lane_io.HELLO.pack(b"testmagc", 1, auth.new_nonce())
    late = threading.Timer(0.6, theirs.sendall, (hello,))  # a slow caller, not a sync
    start = time.monotonic()
    late.start()
    try:
        with pytest.raises(AuthenticationError, match="timed out"):
            lane_io.open_as_callee(ours, b"testmagc", 0, "here", auth.Token(TOKEN))
        assert time.monotonic() - start < 1.4
    finally:
        late.cancel()
        ours.close()
        theirs.close()
