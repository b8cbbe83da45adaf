"""The suites: torch's test classes, by suite name, as shipped in the installed torch.

Each suite also runs the user-facing parts of its tests that are otherwise not
applicable (``conformance/parts.py``, classes named ``*Parts``)."""

from __future__ import annotations

from dataclasses import dataclass

_BASE = "torch.testing._internal.distributed"
# Our own tests: the user-facing parts of torch's tests listed as not applicable.
_PARTS = "conformance.parts"


@dataclass(frozen=True)
class Suite:
    name: str
    # (module, class name) of every test class of the suite, in run order.
    classes: tuple[tuple[str, str], ...]
    # A fault-injecting fixture: torch's FaultyTensorPipeAgent, rrpc's FaultyRpcBackendOptions.
    faulty: bool = False


SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite(
            "rpc",
            (
                (f"{_BASE}.rpc.rpc_test", "RpcTest"),
                (f"{_BASE}.rpc.rpc_test", "TensorPipeAgentRpcTest"),
                (f"{_BASE}.rpc.rpc_test", "CudaRpcTest"),
                (f"{_BASE}.rpc.rpc_test", "TensorPipeAgentCudaRpcTest"),
                (_PARTS, "RpcParts"),
            ),
        ),
        Suite(
            "dist_autograd",
            (
                (f"{_BASE}.rpc.dist_autograd_test", "DistAutogradTest"),
                (f"{_BASE}.rpc.dist_autograd_test", "TensorPipeAgentDistAutogradTest"),
                (f"{_BASE}.rpc.dist_autograd_test", "CudaDistAutogradTest"),
                (f"{_BASE}.rpc.dist_autograd_test", "TensorPipeCudaDistAutogradTest"),
                (_PARTS, "DistAutogradParts"),
            ),
        ),
        Suite("dist_optimizer", ((f"{_BASE}.rpc.dist_optimizer_test", "DistOptimizerTest"),)),
        Suite(
            "faulty",
            (
                (f"{_BASE}.rpc.faulty_agent_rpc_test", "FaultyAgentRpcTest"),
                (f"{_BASE}.rpc.dist_autograd_test", "FaultyAgentDistAutogradTest"),
                (_PARTS, "FaultyAgentRpcParts"),
                (_PARTS, "FaultyAgentDistAutogradParts"),
            ),
            faulty=True,
        ),
        Suite(
            "remote_module",
            (
                (f"{_BASE}.nn.api.remote_module_test", "RemoteModuleTest"),
                (f"{_BASE}.nn.api.remote_module_test", "ThreeWorkersRemoteModuleTest"),
                (f"{_BASE}.nn.api.remote_module_test", "CudaRemoteModuleTest"),
                (_PARTS, "RemoteModuleParts"),
            ),
        ),
        Suite(
            "examples",
            (
                (f"{_BASE}.rpc.examples.parameter_server_test", "ParameterServerTest"),
                (
                    f"{_BASE}.rpc.examples.reinforcement_learning_rpc_test",
                    "ReinforcementLearningRpcTest",
                ),
            ),
        ),
        Suite(
            "ddp",
            (
                (f"{_BASE}.ddp_under_dist_autograd_test", "DdpUnderDistAutogradTest"),
                (f"{_BASE}.ddp_under_dist_autograd_test", "DdpComparisonTest"),
                (f"{_BASE}.ddp_under_dist_autograd_test", "CudaDdpComparisonTest"),
            ),
        ),
    )
}

FRAMEWORKS = ("torch", "rrpc")


def suite_of_class(class_name: str) -> Suite:
    for suite in SUITES.values():
        if any(name == class_name for _, name in suite.classes):
            return suite
    raise KeyError(class_name)
