"""Dynamic membership: workers that join after the others started (world_size=None)."""

import os

import torch

import rrpc
from harness import WorkerGroup, mp_context


def _join_late(rank, world_size, worker1_in, worker2_may_join, worker2_in, finished):
    del os.environ["WORLD_SIZE"]  # the harness sets it; without it membership is dynamic
    if rank == 2:
        assert worker2_may_join.wait(90)
    rrpc.init_rpc(f"worker{rank}", rank=rank)  # no world_size: dynamic membership
    result = None
    if rank == 0:
        assert worker1_in.wait(90)
        worker2_may_join.set()
        assert worker2_in.wait(90)
        # worker0 started before worker2 existed and finds it by name now.
        result = rrpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 2)).tolist()
        finished.set()
    elif rank == 1:
        worker1_in.set()
        assert worker2_in.wait(90)
        result = rrpc.get_worker_info("worker2").id
        assert finished.wait(90)
    else:
        # The late joiner sees everyone who joined before it.
        result = rrpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2), 3)).tolist()
        worker2_in.set()
        assert finished.wait(90)
    rrpc.shutdown()
    return result


def test_worker_joining_after_start_is_reachable_by_everyone_and_reaches_everyone():
    events = [mp_context.Event() for _ in range(4)]
    with WorkerGroup(_join_late, 3, args=events, init=False) as group:
        assert group.wait(110) == [[3.0, 3.0], 2, [3.0, 3.0]]


def _unknown_in_dynamic_world(rank, world_size):
    del os.environ["WORLD_SIZE"]
    rrpc.init_rpc(f"worker{rank}", rank=rank)
    try:
        rrpc.rpc_sync("nobody", torch.add, args=(1, 1))
    except RuntimeError as error:
        message = str(error)
    rrpc.shutdown()
    return message


def test_a_name_nobody_joined_with_is_a_clear_error_in_a_dynamic_world():
    with WorkerGroup(_unknown_in_dynamic_world, 1, init=False) as group:
        [message] = group.wait(110)
    assert "could not find destination worker 'nobody'" in message
