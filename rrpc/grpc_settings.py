"""How rrpc sets gRPC up: channel and server options, the message limit, TLS credentials."""

from __future__ import annotations

import grpc

# The largest gRPC message a worker accepts, whatever its chunk_size below this:
# rrpc cuts frames into packets of chunk_size (2 MiB by default), so a bigger
# message is not rrpc's, and gRPC refuses it from its 5-byte header before it holds
# the bytes. A worker with a chunk_size above it needs the same on its peers.
MIN_PACKET_LIMIT = 64 << 20


def packet_limit(packet_size: int) -> int:
    return max(packet_size, MIN_PACKET_LIMIT)


def options(peer_timeout: float, packet_size: int, server: bool) -> list[tuple[str, int]]:
    """A channel's gRPC options (``server``: the server's). A frozen or cut-off
    peer (its socket still open) is noticed within ``peer_timeout`` seconds at
    both ends of a stream: a keepalive ping every half of it, and the
    connection fails when a ping goes unanswered for the other half. (With
    gRPC's defaults on the server's side, a caller frozen while a reply was
    sent to it kept its stream, and the reply, 20 s whatever ``peer_timeout``.)"""
    half_ms = max(500, int(peer_timeout * 500))
    return [
        # Our packets are bounded by chunk_size; gRPC's own limits must not bite.
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", packet_limit(packet_size)),
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        ("grpc.http2.ping_timeout_ms", half_ms),  # left at its default, keepalive never fires
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        *(_SERVER_OPTIONS if server else _CHANNEL_OPTIONS),
    ]


# Each Connection gets its own TCP connection, not one shared by all channels.
_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    # Accept the callers' keepalive pings (as often as every 0.5 s) without a GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
]


def tls_credentials(
    cert_file: str | None, key_file: str | None, ca_file: str | None
) -> tuple[grpc.ServerCredentials | None, grpc.ChannelCredentials | None]:
    """Server and channel credentials for TLS with client certificates (both
    sides present a certificate signed by ``ca_file``); (None, None) without."""
    files = (cert_file, key_file, ca_file)
    if not any(files):
        return None, None
    if not all(files):
        raise ValueError("TLS needs tls_cert_file, tls_key_file and tls_ca_file together")
    cert, key, ca = (open(path, "rb").read() for path in files)  # type: ignore[arg-type]
    server = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )
    channel = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return server, channel
