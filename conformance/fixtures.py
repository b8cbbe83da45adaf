"""The agent fixtures mixed into torch's test suites (as ``rpc_utils.generate_tests`` does).

torch's suites are written against the abstract ``RpcAgentTestFixture``; each
agent supplies a concrete one. For torch (the control) the runner uses torch's
own ``TensorPipeRpcAgentTestFixture`` / ``FaultyRpcAgentTestFixture``; for
rrpc, ``RrpcAgentTestFixture`` below, and for the faulty suite torch's faulty
fixture with rrpc's ``FaultyRpcBackendOptions``.

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


def _rrpc_faulty_fixture() -> type:
    """torch's ``FaultyRpcAgentTestFixture`` (its default failing and delayed
    message types, ``setup_fault_injection``, its error regexes) with rrpc's
    fault-injecting options, ``rrpc.FaultyRpcBackendOptions``, in place of
    ``FaultyTensorPipeRpcBackendOptions``. Built on first use: the module it
    comes from imports ``torch.distributed.rpc``, which the shim must map first."""
    from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (
        FaultyRpcAgentTestFixture,
    )

    class RrpcFaultyAgentTestFixture(FaultyRpcAgentTestFixture):
        @property
        def rpc_backend(self):
            import rrpc

            return rrpc.BackendType.FAULTY_TENSORPIPE

        @property
        def rpc_backend_options(self):
            import rrpc

            return rrpc.FaultyRpcBackendOptions(  # the arguments torch's fixture passes
                init_method=self.init_method,
                num_worker_threads=8,
                num_fail_sends=3,
                messages_to_fail=self.messages_to_fail,
                messages_to_delay=self.messages_to_delay,
            )

    return RrpcFaultyAgentTestFixture


def fixture_for(framework: str, faulty: bool) -> type:
    """The fixture class of ``framework`` ("torch" or "rrpc") for a normal or faulty suite."""
    if framework == "rrpc":
        return _rrpc_faulty_fixture() if faulty else RrpcAgentTestFixture
    if faulty:
        from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (
            FaultyRpcAgentTestFixture,
        )

        return FaultyRpcAgentTestFixture
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    return TensorPipeRpcAgentTestFixture
