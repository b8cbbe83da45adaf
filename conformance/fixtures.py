"""The agent fixtures mixed into torch's test suites (as ``rpc_utils.generate_tests`` does).

torch's suites are written against the abstract ``RpcAgentTestFixture``; each
agent supplies a concrete one. For torch (the control) the runner uses torch's
own ``TensorPipeRpcAgentTestFixture`` / ``FaultyRpcAgentTestFixture``; for
rrpc, ``RrpcAgentTestFixture`` below.

The error regexes are TensorPipe's on purpose: code written for
``torch.distributed.rpc`` that matches "RPC ran for more than" must keep working
on a drop-in replacement, so a test that fails on the message is a real
difference, not an artefact of the fixture.
"""

from __future__ import annotations

from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture


class RrpcAgentTestFixture(RpcAgentTestFixture):
    """Runs a suite on rrpc: rrpc's backend type and options, TensorPipe's error texts."""

    @property
    def rpc_backend(self):
        import rrpc

        return rrpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):
        import rrpc

        return rrpc.RpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        return "(.*)"  # TensorPipe's

    def get_timeout_error_regex(self) -> str:
        return "RPC ran for more than"  # TensorPipe's


def fixture_for(framework: str, faulty: bool) -> type:
    """The fixture class of ``framework`` ("torch" or "rrpc") for a normal or faulty suite."""
    if framework == "rrpc":
        return RrpcAgentTestFixture
    if faulty:
        from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (
            FaultyRpcAgentTestFixture,
        )

        return FaultyRpcAgentTestFixture
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    return TensorPipeRpcAgentTestFixture
