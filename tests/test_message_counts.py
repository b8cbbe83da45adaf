"""Messages per step: rrpc sends only what the protocol needs, and no more than torch's.

Counted on worker0 over many steps of a steady state, the same steps on both
frameworks in the same test: the requests worker0 sent to worker1, and the
requests worker1 sent to it. rrpc's from worker0's own traffic counters
(`rrpc.stats()`, on the shared three-worker cluster of test_dist_autograd.py);
torch's from TensorPipe's log of every message it writes
(tests/scripts/torch_message_counts.py says how), since torch keeps no message
counters and sends its protocol messages from C++.

torch's protocol, for these steps (its design notes; the message types are
torch's), which its counts confirm:

- `remote(...).to_here()` by the RRef's creator: PYTHON_REMOTE_CALL,
  PYTHON_RREF_FETCH_CALL, and once the RRef is freed RREF_USER_DELETE:
  3 requests (plus their replies).
- A distributed-autograd training step with the model on worker1 behind an
  RRef (`rref.rpc_sync().forward(x)`, `dist_autograd.backward`,
  `DistributedOptimizer.step`, leaving the context): FORWARD_AUTOGRAD_REQ,
  BACKWARD_AUTOGRAD_REQ, the optimizer step's PYTHON_CALL,
  CLEANUP_AUTOGRAD_CONTEXT_REQ: 4 requests from the trainer; and torch's
  worker1 sends about 3 back per step (counted: 59-60 in 20 steps), among
  them its own CLEANUP_AUTOGRAD_CONTEXT_REQ to the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_dist_autograd as dist
import torch

import rrpc
from harness import run_script
from rrpc import autograd_release, messages, metrics
from rrpc.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(240)

STEPS = 20
TORCH_REMOTE_TO_HERE = 3  # requests per remote().to_here(), RRef delete included
TORCH_AUTOGRAD_STEP = 4  # requests per training step from the trainer
TORCH_COUNTS = Path(__file__).resolve().parent / "scripts" / "torch_message_counts.py"


@pytest.fixture
def cluster(request):
    return dist.shared_cluster(request.config)


@pytest.fixture(scope="module")
def torch_counts():
    """{step: [requests worker0 sent, requests worker1 sent to it]} on torch's own RPC."""
    result = run_script(TORCH_COUNTS, str(STEPS), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _served_from(peer: str) -> dict[str, int]:
    """What this worker served for ``peer`` so far, by function or kind (for errors)."""
    return {
        name: row.calls_served
        for (from_peer, name), row in list(rrpc.agent.current_agent().metrics.cells.items())
        if from_peer == peer and row.calls_served
    }


def _traffic(peer: str) -> tuple[int, int]:
    """(requests sent to ``peer``, requests served for it) so far, on this worker."""
    stats = rrpc.stats().get(peer, {})
    return int(stats.get("calls_sent", 0)), int(stats.get("calls_served", 0))


def _releases_sent_to(peer: str) -> int:
    """The AUTOGRAD_RELEASE messages this worker sent ``peer`` so far."""
    cells = rrpc.agent.current_agent().metrics.cells
    row = cells.get((peer, metrics.kind_label(messages.AUTOGRAD_RELEASE)))
    return row.calls_sent if row is not None else 0


def _settled(peer: str) -> tuple[int, int]:
    """``_traffic`` once this worker's RRef DELETEs have all gone out and been answered."""
    rrpc.agent.current_agent().rrefs.drain(30.0)
    return _traffic(peer)


def _make_tensor():
    return torch.ones(4)


def _remote_to_here_counts():
    for _ in range(3):  # warm up: streams open, types cached
        rrpc.remote("worker1", _make_tensor).to_here()
    sent0, served0 = _settled("worker1")
    for _ in range(STEPS):
        assert torch.equal(rrpc.remote("worker1", _make_tensor).to_here(), torch.ones(4))
    sent, served = _settled("worker1")
    return sent - sent0, served - served0


def test_remote_to_here_sends_no_more_than_torch(cluster, torch_counts):
    torch_sent, torch_served = torch_counts["remote_to_here"]
    assert (torch_sent, torch_served) == (TORCH_REMOTE_TO_HERE * STEPS, 0)
    sent, served = cluster.run(_remote_to_here_counts)
    # remote + fetch per iteration; the DELETEs are batched (one message names
    # every RRef dropped within rref_delete_delay): at least one, at most one each
    assert 2 * STEPS < sent <= torch_sent, sent
    assert served == 0  # nothing comes back but replies


def _parameter_rrefs(module_rref):
    return [rrpc.RRef(param) for param in module_rref.local_value().parameters()]


def _autograd_step_counts(release_delay=None):
    """Requests the trainer sends worker1 over STEPS steps, and worker1 back;
    with ``release_delay``, the context releases it sent worker1 before its
    releases were flushed, and after."""
    torch.manual_seed(0)
    module = rrpc.remote("worker1", torch.nn.Linear, args=(8, 8))
    params = rrpc.rpc_sync("worker1", _parameter_rrefs, args=(module,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.randn(4, 8)

    def step():
        with rrpc.autograd.context() as context_id:
            loss = module.rpc_sync().forward(x).sum()
            rrpc.autograd.backward(context_id, [loss])
            optimizer.step(context_id)

    # Set before the warm-up: a flush the scheduler arms during it is then a
    # minute away, not due while the measured steps run.
    previous = autograd_release.RELEASE_DELAY
    autograd_release.RELEASE_DELAY = previous if release_delay is None else release_delay
    try:
        for _ in range(3):
            step()
        rrpc.autograd._wait_releases(30.0)
        sent0, served0 = _traffic("worker1")
        released0 = _releases_sent_to("worker1")
        served_before = _served_from("worker1")
        for _ in range(STEPS):
            step()
        before_flush = _releases_sent_to("worker1") - released0
        rrpc.autograd._wait_releases(30.0)
    finally:
        autograd_release.RELEASE_DELAY = previous
    sent, served = _traffic("worker1")
    if release_delay is None:
        return sent - sent0, served - served0, served_before, _served_from("worker1")
    return before_flush, _releases_sent_to("worker1") - released0


def test_autograd_step_sends_no_more_than_torch(cluster, torch_counts):
    torch_sent, torch_served = torch_counts["autograd_step"]
    assert torch_sent == TORCH_AUTOGRAD_STEP * STEPS, torch_counts
    # torch's worker1 answers the trainer's context release with its own, and
    # more: about 3 requests a step (the last may land after the count ends).
    assert torch_served >= 2 * STEPS, torch_counts
    sent, served, served_before, served_after = cluster.run(_autograd_step_counts)
    # The forward call, the backward pass and the optimizer's step, as torch;
    # the context releases gathered in one message per RELEASE_DELAY
    # (autograd_release.py): one a step at most (steps slower than the delay), at least one.
    assert 3 * STEPS < sent <= torch_sent, sent
    assert served == 0, (
        f"worker1 sent {served} requests back in {STEPS} steps: {served_after}"
        f" (before them: {served_before})"
    )


def test_the_releases_of_many_steps_go_in_one_message(cluster):
    # Held for a minute, the releases of STEPS steps wait until a flush, then
    # go to worker1 together, RELEASE_BATCH to a message at most (those go at
    # once): without the batching, one went every step; without the bound,
    # all STEPS waited for the minute.
    batch = autograd_release.RELEASE_BATCH
    assert STEPS % batch, "a few releases must be left over for the flush"
    before_flush, after_flush = cluster.run(_autograd_step_counts, 60.0)
    assert (before_flush, after_flush) == (STEPS // batch, STEPS // batch + 1)
