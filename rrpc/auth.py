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

NONCE_SIZE = 32
PROOF_SIZE = hashlib.sha256().digest_size
NONCE_KEY = "rrpc-nonce"  # stream metadata: the caller's nonce, in hex
CALLER = b"caller"
CALLEE = b"callee"
_LABEL = b"rrpc-auth-1\0"
_RANKS = struct.Struct("<qq")


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
