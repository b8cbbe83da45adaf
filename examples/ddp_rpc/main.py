"""DDP and RPC together: a dense part replicated by DDP, an embedding table on a server.

This is the pattern of PyTorch's "Combining Distributed DataParallel with
Distributed RPC Framework" tutorial, with three processes:

- rank 0, ``ps``: holds an ``nn.EmbeddingBag`` table and drives the run (it is
  also the tutorial's "master").
- ranks 1 and 2, the trainers: each holds a replica of the dense part (an
  ``nn.Linear``) wrapped in ``DistributedDataParallel``; the two form their own
  gloo process group. A trainer looks up its bags of token ids in the remote
  table through an RRef (``emb_rref.rpc_sync().forward(...)``) and feeds the
  result to its DDP replica.

Inside one ``dist_autograd.context()``, one ``dist_autograd.backward`` sends the
embedding's gradients to the server while DDP averages the dense gradients
between the trainers, and one ``DistributedOptimizer`` step updates both the
remote embedding and the local dense parameters (wrapped as ``RRef(p)``).

The task is synthetic and fixed by seeds: each of 8 classes has its own 10
"topic" tokens, and a bag of 4..12 tokens draws 70% of them from its class's
topic, the rest from the whole vocabulary of 100. The run shows the loss
dropping, the held-out accuracy of the final model, and that the DDP replicas
end bit-for-bit identical (max abs difference 0).

Run (one command; it starts all three processes on this machine):

    python examples/ddp_rpc/main.py
    python examples/ddp_rpc/main.py --framework torch   # the same on torch.distributed.rpc
    python examples/ddp_rpc/main.py --smoke             # a few seconds
    torchrun --nproc-per-node 3 examples/ddp_rpc/main.py

It prints one line per epoch (from the first trainer) and a summary, and writes
metrics.json and loss.png to --out (default: examples/ddp_rpc/out/).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # noqa: E402
    framework_from_argv,
    launch,
    plot,
    rpc_framework,
    summary,
    write_metrics,
)

# `--framework torch` runs this same file on torch.distributed.rpc, the API rrpc mirrors.
rpc, dist_autograd, DistributedOptimizer = rpc_framework(framework_from_argv())

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
TOPIC_SIZE = 10  # tokens per class topic: class c's topic is c*10 .. c*10+9


def make_bags(num_samples: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``num_samples`` bags of token ids and their labels, fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(NUM_CLASSES, (num_samples,), generator=generator)
    bags = []
    for label in labels.tolist():
        length = int(torch.randint(4, 13, (), generator=generator))
        topical = torch.rand(length, generator=generator) < 0.7
        topic = label * TOPIC_SIZE + torch.randint(TOPIC_SIZE, (length,), generator=generator)
        anywhere = torch.randint(NUM_EMBEDDINGS, (length,), generator=generator)
        bags.append(torch.where(topical, topic, anywhere))
    return bags, labels


def collate(bags: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """EmbeddingBag's input: all ids in one tensor, and where each bag starts."""
    lengths = torch.tensor([0] + [len(bag) for bag in bags[:-1]])
    return torch.cat(bags), torch.cumsum(lengths, dim=0)


def parameter_rrefs(module_rref) -> list:
    """Runs on the module's owner: an RRef to each of its parameters."""
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


class HybridModel(nn.Module):
    """The remote embedding table (through an RRef) followed by a local DDP replica."""

    def __init__(self, emb_rref):
        super().__init__()
        self.emb_rref = emb_rref
        # DDP over the default process group: the trainers' group.
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        embedded = self.emb_rref.rpc_sync().forward(indices, offsets)
        return self.fc(embedded)


# -- The trainers (ranks 1 and 2) -----------------------------------------------


def run_trainer(emb_rref, args: argparse.Namespace) -> dict:
    """Train on this trainer's own data; return its history and dense replica."""
    rank = rpc.get_worker_info().id - 1  # 0 and 1 in the DDP group
    num_trainers = args.trainers

    # The trainers' DDP group meets in the store that the RPC rendezvous already
    # runs at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), under a prefix of its own.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("ddp/", store), rank=rank, world_size=num_trainers
    )
    # Each trainer draws different initial weights; DDP starts all replicas from
    # trainer 0's (it broadcasts them), then averages every gradient.
    torch.manual_seed(args.seed + rank)
    model = HybridModel(emb_rref)

    # One optimizer over the remote embedding and the local dense parameters.
    param_rrefs = [rpc.RRef(p) for p in model.fc.parameters()]
    param_rrefs += rpc.rpc_sync(emb_rref.owner(), parameter_rrefs, args=(emb_rref,))
    optimizer = DistributedOptimizer(optim.SGD, param_rrefs, lr=args.lr, momentum=0.9)

    bags, labels = make_bags(args.samples, seed=args.seed + 1 + rank)
    generator = torch.Generator().manual_seed(args.seed + 100 + rank)
    history = []
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        total_loss, correct = 0.0, 0
        order = torch.randperm(len(bags), generator=generator).tolist()
        for start in range(0, len(order), args.batch_size):
            batch = order[start : start + args.batch_size]
            indices, offsets = collate([bags[i] for i in batch])
            target = labels[batch]
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = F.cross_entropy(output, target)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total_loss += loss.item() * len(batch)
            correct += (output.argmax(dim=1) == target).sum().item()
        seconds = time.perf_counter() - started
        history.append(
            {
                "epoch": epoch,
                "loss": total_loss / len(bags),
                "train_accuracy": correct / len(bags),
                "samples_per_s": len(bags) / seconds,
            }
        )
        if rank == 0:
            h = history[-1]
            print(
                f"epoch {epoch:3d}/{args.epochs}  loss {h['loss']:.4f}  "
                f"train acc {h['train_accuracy']:.4f}  "
                f"{h['samples_per_s']:6.0f} samples/s per trainer",
                flush=True,
            )
    dense = {name: p.detach().clone() for name, p in model.fc.module.named_parameters()}
    dist.destroy_process_group()
    return {"history": history, "dense": dense}


# -- The server and driver (rank 0) ---------------------------------------------


def run_master(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    embedding = nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM, mode="mean")
    emb_rref = rpc.RRef(embedding)
    print(
        f"{args.framework}: embedding table {NUM_EMBEDDINGS}x{EMBEDDING_DIM} on ps, "
        f"{args.trainers} DDP trainers x {args.samples} bags",
        flush=True,
    )
    started = time.perf_counter()
    futures = [
        rpc.rpc_async(f"trainer{rank}", run_trainer, args=(emb_rref, args))
        for rank in range(1, args.trainers + 1)
    ]
    results = torch.futures.wait_all(futures)
    training_seconds = time.perf_counter() - started

    # The DDP replicas must be identical; compare every trainer's with the first's.
    first = results[0]["dense"]
    replica_max_abs_diff = max(
        (other["dense"][name] - first[name]).abs().max().item()
        for other in results[1:]
        for name in first
    )
    # Held-out accuracy of the trained model: the embedding here, a dense replica.
    dense = nn.Linear(EMBEDDING_DIM, NUM_CLASSES)
    dense.load_state_dict(first)
    test_bags, test_labels = make_bags(1000, seed=args.seed + 999)
    with torch.no_grad():
        predictions = dense(embedding(*collate(test_bags))).argmax(dim=1)
    test_accuracy = (predictions == test_labels).float().mean().item()

    history = results[0]["history"]
    losses = {
        f"trainer{rank}": [h["loss"] for h in result["history"]]
        for rank, result in enumerate(results, start=1)
    }
    metrics = {
        "example": "ddp_rpc",
        "framework": args.framework,
        "trainers": args.trainers,
        "epochs": args.epochs,
        "samples_per_trainer": args.samples,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "first_loss": {name: values[0] for name, values in losses.items()},
        "final_loss": {name: values[-1] for name, values in losses.items()},
        "loss_decreased": all(values[-1] < values[0] for values in losses.values()),
        "replica_max_abs_diff": replica_max_abs_diff,
        "test_accuracy": test_accuracy,
        "training_seconds": training_seconds,
        "wall_seconds": time.time() - args.launched_at,
        "history": {f"trainer{r}": res["history"] for r, res in enumerate(results, start=1)},
    }
    out = Path(args.out)
    png = plot(
        str(out / "loss.png"),
        losses,
        xlabel="epoch",
        ylabel="training loss",
        title=f"DDP + RPC ({args.trainers} trainers, {args.framework})",
    )
    metrics_path = write_metrics(str(out / "metrics.json"), metrics)
    print(
        summary(
            f"DDP + RPC · {args.framework}",
            {
                "trainers": f"{args.trainers} (DDP over gloo) + embedding table on ps",
                "loss": " | ".join(
                    f"{name} {values[0]:.3f} -> {values[-1]:.3f}" for name, values in losses.items()
                ),
                "test accuracy": f"{test_accuracy:.4f} (1000 held-out bags)",
                "DDP replicas": f"max abs diff {replica_max_abs_diff:g}"
                + (" (identical)" if replica_max_abs_diff == 0 else " (DIFFERENT)"),
                "training time": f"{training_seconds:.1f} s",
                "wall time": f"{metrics['wall_seconds']:.1f} s (incl. start-up)",
                "throughput": f"{history[-1]['samples_per_s']:.0f} samples/s per trainer "
                "(last epoch)",
                "metrics": metrics_path,
                "plot": png or "(matplotlib not installed)",
            },
        ),
        flush=True,
    )


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    args.trainers = world_size - 1
    name = "ps" if rank == 0 else f"trainer{rank}"
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        run_master(args)
    # The trainers work when the master calls them; shutdown waits for everyone.
    rpc.shutdown()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["rrpc", "torch"], default="rrpc")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=2048, help="bags per trainer")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="small sizes, for tests")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples = 3, 512
    args.launched_at = time.time()
    return args


if __name__ == "__main__":
    args = parse_args()
    launch(main, args.trainers + 1, args)
