"""TLS: every stream encrypted, both ends authenticated by certificates of one CA."""

import shutil
import subprocess

import grpc
import pytest
import torch

import rrpc
from harness import run_workers

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("tls"))


def make_certificates(folder):
    """A CA and one worker certificate for 127.0.0.1, signed by it (PEM files in `folder`)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=rrpc-test-ca", "-keyout", "ca.key", "-out", "ca.pem",
             cwd=folder)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
             "-keyout", "worker.key", "-out", "worker.csr", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "worker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "worker.pem",
             cwd=folder)  # fmt: skip
    return {name: str(folder / file) for name, file in
            (("cert", "worker.pem"), ("key", "worker.key"), ("ca", "ca.pem"))}  # fmt: skip


def _add_over_tls(rank, world_size):
    if rank == 0:
        value = rrpc.rpc_sync("worker1", torch.add, args=(torch.arange(3), 1)).tolist()
        # A peer without a certificate of the CA gets no answer at all.
        channel = grpc.insecure_channel(rrpc.agent.current_agent().address)
        call = channel.stream_stream("/rrpc.Worker/Exchange")(iter([b"\x00" * 8]))
        try:
            next(call)
            plaintext = "answered"
        except grpc.RpcError as error:
            plaintext = error.code().name
        finally:
            channel.close()
        return value, plaintext
    return None


def test_workers_with_ca_signed_certificates_talk_and_plaintext_peers_are_refused(certificates):
    env = {
        "RRPC_TLS_CERT": certificates["cert"],
        "RRPC_TLS_KEY": certificates["key"],
        "RRPC_TLS_CA": certificates["ca"],
    }
    [(value, plaintext), _] = run_workers(_add_over_tls, 2, env=env, timeout=90)
    assert value == [1, 2, 3]
    assert plaintext == "UNAVAILABLE"
