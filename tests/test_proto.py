"""The generated code in rrpc/_proto is what proto/rrpc.proto generates today."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_committed_protobuf_code_is_current(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    status = protoc.main(
        [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            str(ROOT / "proto" / "rrpc.proto"),
        ]
    )
    assert status == 0
    fresh = (tmp_path / "rrpc_pb2.py").read_text()
    committed = (ROOT / "rrpc" / "_proto" / "rrpc_pb2.py").read_text()
    assert fresh == committed, "rrpc/_proto is stale: run `make proto` and commit the result"
