"""Both ends of a stream prove they know the cluster's token; the token never travels.

Theory of operation: a challenge-response with HMAC-SHA256, once per stream
(streams live as long as the workers), so no call pays for it::

    caller                                              callee
      opens the stream; metadata: rrpc-rank, rrpc-nonce = Nc
                                       <-  HANDSHAKE(nonce = Ns, proof = P_callee)
      checks P_callee
      HANDSHAKE(proof = P_caller), then its queued requests  ->
                                                        checks P_caller, then
                                                        reads the requests

    P_role = HMAC-SHA256(token, "rrpc-auth-1" | role | caller rank | callee rank
                                | Nc | Ns | callee's advertised address)

Nc and Ns are fresh random nonces of ``NONCE_SIZE`` bytes (``os.urandom``).
A HANDSHAKE frame is an envelope alone (``handshake_frame``), which
``read_handshake`` reads strictly, before anything else the peer sent.

Each end's side is bytes in, bytes out (``CallerHandshake``,
``CalleeHandshake``): the carrier sends the frames, reads the first packet,
and times the wait (``transport.py`` on a gRPC stream).

Rules:
- The token itself never leaves the process, and no proof is worth anything
  twice: each covers both nonces, each end draws a fresh one per stream, and
  the two roles' proofs differ (a proof cannot be reflected back).
- The caller sends nothing but the nonce, and unpickles nothing, until the
  callee proved itself; the callee reads no frame until the caller did.
- The callee's advertised address is in both proofs, so a worker that
  registered someone else's name with its own address (in the rendezvous
  store) cannot relay the real worker's proof: the real one proves it for its
  own address, and the caller checks it for the one it dialled.
- Proofs are compared with ``hmac.compare_digest``.
- Without TLS, this authenticates the stream's two ends when it opens; it
  does not encrypt nor sign what follows. Against an attacker on the network
  path itself, use TLS with client certificates (``RRPC_TLS_*``) as well.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from rrpc._proto.rrpc_pb2 import Envelope, Handshake
from rrpc.messages import HANDSHAKE, AuthenticationError, ProtocolError
from rrpc.wire import HEADER

NONCE_SIZE = 32
PROOF_SIZE = hashlib.sha256().digest_size
NONCE_KEY = "rrpc-nonce"  # stream metadata: the caller's nonce, in hex
CALLER = b"caller"
CALLEE = b"callee"
_LABEL = b"rrpc-auth-1\0"
_RANKS = struct.Struct("<qq")
MAX_HANDSHAKE_ENVELOPE = 256  # a handshake envelope is ~75 bytes
REFUSED = "wrong or missing auth token"  # all a refused caller is told


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


@dataclass(frozen=True)
class Binding:
    """What both proofs of one stream cover, besides the role."""

    caller_rank: int
    callee_rank: int
    callee_address: str
    caller_nonce: bytes
    callee_nonce: bytes

    def __post_init__(self) -> None:
        # Fixed sizes keep the proven bytes unambiguous (the address goes last).
        if len(self.caller_nonce) != NONCE_SIZE or len(self.callee_nonce) != NONCE_SIZE:
            raise ValueError(f"auth nonces are {NONCE_SIZE} bytes")


class Token:
    """The cluster's shared secret. Its ``repr`` does not show it."""

    def __init__(self, secret: str):
        self._key = secret.encode()

    def __repr__(self) -> str:
        return "Token(<hidden>)"

    def proof(self, role: bytes, binding: Binding) -> bytes:
        message = b"".join(
            (
                _LABEL,
                role,
                b"\0",
                _RANKS.pack(binding.caller_rank, binding.callee_rank),
                binding.caller_nonce,
                binding.callee_nonce,
                binding.callee_address.encode(),
            )
        )
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def verify(self, role: bytes, binding: Binding, proof: bytes) -> bool:
        return hmac.compare_digest(self.proof(role, binding), proof)


# -- The handshake frame ---------------------------------------------------------
def handshake_frame(nonce: bytes, proof: bytes) -> bytes:
    """The frame that opens one direction of an authenticated stream."""
    envelope = Envelope(kind=HANDSHAKE)
    envelope.handshake.nonce = nonce
    envelope.handshake.proof = proof
    head = envelope.SerializeToString()
    return HEADER.pack(len(head)) + head


def read_handshake(packet: bytes) -> tuple[Handshake, bytes]:
    """The handshake frame a stream's first packet must open with, and the
    bytes after it (frames to read once the peer is trusted).

    Strict, and reads nothing of the peer's but that small envelope: anything
    else (another kind, a payload, buffers, a frame cut across packets) is a
    ``ProtocolError``."""
    if len(packet) < HEADER.size:
        raise ProtocolError(f"{len(packet)} bytes where an auth handshake was expected")
    (head_size,) = HEADER.unpack_from(packet)
    end = HEADER.size + head_size
    if head_size > MAX_HANDSHAKE_ENVELOPE or end > len(packet):
        raise ProtocolError(f"an envelope of {head_size} bytes is not an auth handshake")
    envelope = Envelope()
    try:
        envelope.ParseFromString(memoryview(packet)[HEADER.size : end])
    except Exception as exc:
        raise ProtocolError(f"unparseable handshake envelope: {exc}") from exc
    if envelope.kind != HANDSHAKE:
        raise ProtocolError(f"a frame of kind {envelope.kind} where an auth handshake was expected")
    if envelope.payload_size or envelope.buffer_sizes or envelope.shared_buffers:
        raise ProtocolError("an auth handshake carries no payload nor buffers")
    return envelope.handshake, packet[end:]


# -- Both ends of one stream's handshake -------------------------------------------
class CallerHandshake:
    """The caller's side on one stream: ``nonce`` goes in the stream's
    metadata; ``check`` reads the callee's first packet and, once the callee
    proved itself, sets ``proof``, the frame to send before any request."""

    def __init__(self, token: Token, ranks: tuple[int, int], address: str, peer_name: str):
        """``ranks``: this worker's and the callee's; ``address``: the one dialled."""
        self.nonce = new_nonce()
        self.proof: bytes | None = None
        self._token = token
        self._ranks = ranks
        self._address = address
        self._peer_name = peer_name

    def check(self, first: bytes | None) -> bytes:
        """Check the callee's handshake in ``first`` (None: the stream ended
        before any packet); the bytes after it. Raises AuthenticationError."""
        peer = self._peer_name
        if first is None:
            raise AuthenticationError(f"{peer} ended the stream before it authenticated")
        try:
            handshake, rest = read_handshake(first)
        except ProtocolError as exc:
            raise AuthenticationError(
                f"{peer} at {self._address} did not authenticate ({exc}): it does not know "
                "the auth token, or it is not the worker of that name"
            ) from None
        if len(handshake.nonce) != NONCE_SIZE:
            raise AuthenticationError(f"{peer} sent an auth handshake without a valid nonce")
        binding = Binding(*self._ranks, self._address, self.nonce, handshake.nonce)
        if not self._token.verify(CALLEE, binding, handshake.proof):
            raise AuthenticationError(
                f"{peer} at {self._address} failed to prove it knows the auth token: its "
                "token differs from this worker's, or it is not the worker of that name"
            )
        self.proof = handshake_frame(b"", self._token.proof(CALLER, binding))
        return rest

    def timed_out(self, timeout: float) -> AuthenticationError:
        return AuthenticationError(
            f"{self._peer_name} at {self._address} did not authenticate within {timeout:g} s"
        )


class Refused(AuthenticationError):
    """The callee refused a caller. ``kind`` tells the reasons apart in the
    callee's log (``logs.event``); the caller is told only ``REFUSED``."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


class CalleeHandshake:
    """The callee's side on one stream: ``frame`` is sent first; ``check``
    reads the caller's first packet. Raises ``Refused``, before any frame of
    the caller is read, if it did not prove itself."""

    def __init__(
        self,
        token: Token,
        caller_rank: int,
        callee_rank: int,
        callee_address: str,
        caller_nonce_hex: str,
    ):
        """``caller_nonce_hex``: the caller's nonce, as its stream's metadata
        carries it (``NONCE_KEY``)."""
        try:
            caller_nonce = bytes.fromhex(caller_nonce_hex)
        except ValueError:
            caller_nonce = b""
        if len(caller_nonce) != NONCE_SIZE:
            raise Refused("refused:nonce", f"{REFUSED} (no valid auth nonce in its metadata)")
        self._token = token
        self._binding = Binding(caller_rank, callee_rank, callee_address, caller_nonce, new_nonce())
        self.frame = handshake_frame(self._binding.callee_nonce, token.proof(CALLEE, self._binding))

    def check(self, first: bytes) -> bytes:
        """Check the caller's handshake in ``first``; the bytes after it."""
        try:
            handshake, rest = read_handshake(first)
            reason = "wrong auth proof: it does not know the token"
        except ProtocolError as exc:
            handshake, rest, reason = None, b"", f"no auth handshake: {exc}"
        if handshake is None or not self._token.verify(CALLER, self._binding, handshake.proof):
            raise Refused("refused:proof", f"{REFUSED} ({reason})")
        return rest
