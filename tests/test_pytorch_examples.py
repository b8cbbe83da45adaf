"""PyTorch's examples run on rrpc train exactly as they do on torch.distributed.rpc.

``pytorch/examples``' ``distributed/rpc/ddp_rpc`` pattern, in a few iterations:
a master creates a ``RemoteModule`` embedding table on a parameter server
("ps/cpu"), sends it to two trainers, and each trainer wraps a local
``nn.Linear`` in DDP (gloo, a process group of the trainers only), builds a
``DistributedOptimizer`` over the table's ``remote_parameters()`` and its DDP
parameters (as local RRefs), and trains with ``dist_autograd.backward`` and
``opt.step``. The code is written once against the names ``rpc``,
``dist_autograd``, ``DistributedOptimizer`` and ``RemoteModule``, bound to
torch's or to rrpc's at the start of each process; the test runs it on both
and asserts that the trained parameters (and the losses on the way) are equal.

Deterministic by construction: seeds fix the initial weights and the batches,
and each trainer looks up its own half of the table, so the trainers' updates
of the shared table (plain SGD: a zero gradient leaves a row as it is)
commute whatever order they arrive in. The optimizer is a subclass of SGD
(``_SGD``) so that torch steps it in its class form, under the lock that
serializes steps on a worker: for SGD itself torch uses its TorchScript form,
which steps without that lock (and without the GIL), so the two trainers'
steps of the table on "ps" could run at once, each writing back all rows, and
lose an update (rrpc serializes both forms, as torch's documentation says).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import free_port, run_workers

# The names the example uses, bound to one framework in each process (_bind).
rpc = dist_autograd = DistributedOptimizer = RemoteModule = None

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
TRAINERS = 2
EPOCHS = 3
BATCHES = 4  # per epoch
SEED = 0
WORLD = ["trainer0", "trainer1", "master", "ps"]  # by rank, as in the example
TIMEOUT = 60  # seconds per framework, start-up included


def _bind(framework: str) -> None:
    global rpc, dist_autograd, DistributedOptimizer, RemoteModule
    if framework == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.nn import RemoteModule
        from torch.distributed.optim import DistributedOptimizer
    else:
        import rrpc as rpc
        import rrpc.autograd as dist_autograd
        from rrpc.nn import RemoteModule
        from rrpc.optim import DistributedOptimizer


class HybridModel(torch.nn.Module):
    """The table on the parameter server (a RemoteModule), then a local DDP replica."""

    def __init__(self, remote_table):
        super().__init__()
        self.remote_table = remote_table
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, NUM_CLASSES))

    def forward(self, indices, offsets):
        return self.fc(self.remote_table.forward(indices, offsets))


def _batches(trainer: int):
    """Bags of ids from this trainer's half of the table, with their offsets and labels."""
    generator = torch.Generator().manual_seed(SEED + 10 + trainer)
    low = trainer * NUM_EMBEDDINGS // TRAINERS
    high = low + NUM_EMBEDDINGS // TRAINERS
    for _ in range(BATCHES):
        num_indices = int(torch.randint(20, 51, (), generator=generator))
        indices = torch.randint(low, high, (num_indices,), generator=generator)
        offsets = torch.arange(0, num_indices, 5)
        target = torch.randint(NUM_CLASSES, (len(offsets),), generator=generator)
        yield indices, offsets, target


class _SGD(torch.optim.SGD):
    """SGD by another name: not in torch's functional map (see the module doc)."""


def _train(remote_table, trainer: int) -> dict:
    """On a trainer (called by the master over RPC): train; return losses and replica."""
    model = HybridModel(remote_table)
    parameter_rrefs = remote_table.remote_parameters()
    parameter_rrefs += [rpc.RRef(param) for param in model.fc.parameters()]
    opt = DistributedOptimizer(_SGD, parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for _ in range(EPOCHS):
        for indices, offsets, target in _batches(trainer):
            with dist_autograd.context() as context_id:
                loss = criterion(model(indices, offsets), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(loss.item())
    return {"losses": losses, "fc": [p.detach().clone() for p in model.fc.module.parameters()]}


def _table_weight(remote_table) -> torch.Tensor:
    return remote_table.remote_parameters()[0].to_here().detach().clone()


def _run(rank: int, world_size: int, framework: str, ddp_port: int):
    _bind(framework)
    # One intra-op thread: the table's gradient (EmbeddingBag's backward) sums
    # in parallel in an order that varies from run to run, on either framework
    # (torch against itself differed by 0.006 after training, 1 run in 4).
    torch.set_num_threads(1)
    torch.manual_seed(SEED + rank)
    name = WORLD[rank]
    if name.startswith("trainer"):
        # DDP's constructor imports torch._dynamo (2-3 s under load): done here,
        # not on an RPC thread in _train. Once, with every fast path off, torch's
        # own run aborted (SIGABRT) inside that import on its RPC thread.
        importlib.import_module("torch._dynamo")

        # DDP among the trainers, in a process group of its own, on its own port.
        init_method = f"tcp://127.0.0.1:{ddp_port}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=TRAINERS)
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    result = None
    if name == "master":
        remote_table = RemoteModule(
            "ps/cpu",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"},
        )
        initial = _table_weight(remote_table)
        futures = [
            rpc.rpc_async(f"trainer{trainer}", _train, args=(remote_table, trainer))
            for trainer in range(TRAINERS)
        ]
        trainers = [future.wait() for future in futures]
        result = {"initial": initial, "table": _table_weight(remote_table), "trainers": trainers}
    rpc.shutdown()
    if name.startswith("trainer"):
        dist.destroy_process_group()
    return result


def _train_on(framework: str) -> dict:
    results = run_workers(
        _run, world_size=len(WORLD), args=(framework, free_port()), timeout=TIMEOUT, init=False
    )
    return results[WORLD.index("master")]


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_ddp_with_a_remote_module_trains_as_on_torch():
    on_torch, on_rrpc = _train_on("torch"), _train_on("rrpc")
    for result in (on_torch, on_rrpc):
        first, second = result["trainers"]
        for a, b in zip(first["fc"], second["fc"], strict=True):
            assert torch.equal(a, b)  # DDP kept the replicas identical
        assert not torch.equal(result["table"], result["initial"])  # the table trained
    assert torch.equal(on_rrpc["initial"], on_torch["initial"])
    assert torch.equal(on_rrpc["table"], on_torch["table"])
    for rrpc_trainer, torch_trainer in zip(on_rrpc["trainers"], on_torch["trainers"], strict=True):
        assert rrpc_trainer["losses"] == torch_trainer["losses"]
        for a, b in zip(rrpc_trainer["fc"], torch_trainer["fc"], strict=True):
            assert torch.equal(a, b)
