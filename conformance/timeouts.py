"""Per-test time limits (seconds), for the zygote's deadline on a test's world.

torch's own limit is 300 s for every test (``common_distributed.get_timeout``);
here most tests finish in 1-3 s, so the default is tighter, and the few that
legitimately take long get more.
"""

from __future__ import annotations

DEFAULT_TIMEOUT = 60.0

TIMEOUTS: dict[str, float] = {
    "ReinforcementLearningRpcTest.test_rl_rpc": 180.0,
    "ParameterServerTest.test_batch_updating_parameter_server": 120.0,
    "DdpUnderDistAutogradTest.test_backward_ddp_inside": 120.0,
    "DdpUnderDistAutogradTest.test_backward_ddp_outside": 120.0,
    "DdpUnderDistAutogradTest.test_backward_ddp_outside_uneven_inputs": 120.0,
    "DdpUnderDistAutogradTest.test_backward_no_ddp": 120.0,
}


def timeout_for(test: str) -> float:
    return TIMEOUTS.get(test, DEFAULT_TIMEOUT)
