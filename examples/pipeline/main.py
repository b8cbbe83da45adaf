"""Pipeline parallelism with RPC: a model split in two stages on two workers.

The pattern of PyTorch's tutorial "Distributed Pipeline Parallelism Using
RPC". An MLP that classifies scikit-learn's handwritten digits is cut in two
stages; ``worker1`` holds the first and ``worker2`` the second, each created
with ``rpc.remote``. The master (rank 0) holds RRefs to both stages and the
data. Each batch is cut into micro-batches: every micro-batch goes through
stage 1 (``p1_rref.remote().forward(x_rref)``, which returns an RRef to the
output) and on to stage 2 (``p2_rref.rpc_async().forward(y_rref)``) without
waiting, so stage 1 works on micro-batch i+1 while stage 2 works on i. The
master gathers the outputs (``torch.futures.wait_all``, ``torch.cat``),
computes the loss, runs ``dist_autograd.backward`` and steps a
``DistributedOptimizer`` that updates each stage's parameters where they live.

It trains the model once for each of 1, 2, 4 and 8 micro-batches, always from
the same initial weights, and checks every step's loss against the same model
trained in one process (same weights, data and optimizer), then prints the
throughput of each.

Run (3 processes: master + 2 stages; ``--framework torch`` runs the very same
code on ``torch.distributed.rpc``)::

    python examples/pipeline/main.py
    python examples/pipeline/main.py --smoke           # tiny sizes, seconds
    torchrun --nproc-per-node 3 examples/pipeline/main.py

Metrics go to ``--out`` (default ``examples/pipeline/out/``): ``metrics.json``
and ``loss.png``.
"""

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import launch, plot, progress, rpc_framework, summary, write_metrics  # noqa: E402

MICRO_BATCHES = (1, 2, 4, 8)

# torch.distributed.rpc or rrpc, with its autograd and optimizer; chosen by
# --framework in run_worker.
rpc = dist_autograd = DistributedOptimizer = None


# Tanh, not ReLU: micro-batches sum their gradients in another order than one
# big batch does, which changes the last bits; with ReLU such a bit can switch a
# unit on or off and the runs drift apart by more than rounding. A smooth model
# keeps the pipeline's loss equal to one process's at every step.


class Stage1(nn.Module):
    """Digits (64 pixels) -> hidden features."""

    def __init__(self, hidden, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.seq = nn.Sequential(
            nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self._lock = threading.Lock()

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:  # micro-batches pass through a stage one at a time
            return self.seq(x)

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


class Stage2(nn.Module):
    """Hidden features -> scores for the 10 digits."""

    def __init__(self, hidden, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.seq = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 10))
        self._lock = threading.Lock()

    def forward(self, y_rref):
        y = y_rref.to_here()
        with self._lock:
            return self.seq(y)

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


class DistMLP(nn.Module):
    """Runs on the master: drives the two remote stages, micro-batch by micro-batch."""

    def __init__(self, num_micro_batches, hidden, seed):
        super().__init__()
        self.num_micro_batches = num_micro_batches
        self.p1_rref = rpc.remote("worker1", Stage1, args=(hidden, seed))
        self.p2_rref = rpc.remote("worker2", Stage2, args=(hidden, seed + 1))

    def forward(self, xs):
        out_futures = []
        for x in xs.chunk(self.num_micro_batches):
            x_rref = rpc.RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        return self.p1_rref.rpc_sync().parameter_rrefs() + self.p2_rref.rpc_sync().parameter_rrefs()


def batches(x, y, batch_size, epochs, seed):
    """The same shuffled batches for every run."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]


def train_pipeline(num_micro_batches, data, args):
    """Trains a fresh DistMLP; returns its per-step losses, samples/s and test accuracy."""
    x_train, y_train, x_test, y_test = data
    model = DistMLP(num_micro_batches, args.hidden, args.seed)
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=args.lr, momentum=0.9)
    with torch.no_grad():  # warm-up, not timed: first calls set up connections and kernels
        model(x_train[: args.batch_size])
    losses, samples = [], 0
    steps = args.epochs * (len(x_train) // args.batch_size)
    start = time.perf_counter()
    for inputs, labels in progress(
        batches(x_train, y_train, args.batch_size, args.epochs, args.seed),
        desc=f"{num_micro_batches} micro-batches",
        total=steps,
    ):
        with dist_autograd.context() as context_id:
            loss = F.cross_entropy(model(inputs), labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        losses.append(loss.item())
        samples += len(inputs)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return losses, samples / seconds, accuracy


def train_local(data, args):
    """The reference: the same two stages, weights, batches and optimizer, in this process."""
    x_train, y_train, _, _ = data
    model = nn.Sequential(
        Stage1(args.hidden, args.seed).seq, Stage2(args.hidden, args.seed + 1).seq
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for inputs, labels in batches(x_train, y_train, args.batch_size, args.epochs, args.seed):
        loss = F.cross_entropy(model(inputs), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def load_data(seed):
    """scikit-learn's 1797 digits (8x8 pixels), 80% to train and 20% to test."""
    from sklearn.datasets import load_digits  # here: only the master needs it

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = order[: len(x) * 4 // 5], order[len(x) * 4 // 5 :]
    return x[train], y[train], x[test], y[test]


def run_master(args):
    data = load_data(args.seed)
    print(
        f"{args.framework} RPC: MLP 64-{args.hidden}-{args.hidden} | {args.hidden}-{args.hidden}-10"
        f" on 2 workers, batch {args.batch_size}, {args.epochs} epochs"
    )
    local_losses = train_local(data, args)
    runs = {}
    for m in MICRO_BATCHES:
        losses, throughput, accuracy = train_pipeline(m, data, args)
        max_diff = max(abs(a - b) for a, b in zip(losses, local_losses, strict=True))
        runs[m] = {
            "losses": losses,
            "samples_per_s": throughput,
            "test_accuracy": accuracy,
            "max_loss_diff": max_diff,
        }
        print(
            f"{m} micro-batches: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            f" (local {local_losses[0]:.4f} -> {local_losses[-1]:.4f}, max diff {max_diff:.1e})"
            f"  test acc {accuracy:.3f}  {throughput:7.0f} samples/s",
            flush=True,
        )
    return {
        "framework": args.framework,
        "hidden": args.hidden,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "steps": len(local_losses),
        "local_losses": local_losses,
        "micro_batches": {str(m): run for m, run in runs.items()},
    }


def report(metrics, out):
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_metrics(str(out / "metrics.json"), metrics)
    runs = metrics["micro_batches"]
    series = {"one process": metrics["local_losses"]}
    series.update({f"pipeline, {m} micro-batches": run["losses"] for m, run in runs.items()})
    png_path = plot(
        str(out / "loss.png"),
        series,
        "step",
        "training loss",
        "Pipeline over RPC vs one process (the curves coincide)",
    )
    base = runs["1"]["samples_per_s"]
    rows = {
        f"{m} micro-batch{'es' if m != '1' else ''}": f"{run['samples_per_s']:7.0f} samples/s"
        f"  ×{run['samples_per_s'] / base:.2f}  max |Δloss| {run['max_loss_diff']:.1e}"
        f"  test acc {run['test_accuracy']:.3f}"
        for m, run in runs.items()
    }
    rows["final loss"] = (
        f"{runs['1']['losses'][-1]:.5f} pipeline, {metrics['local_losses'][-1]:.5f} one process"
    )
    rows["metrics"] = json_path
    rows["plot"] = png_path
    print(
        summary(
            f"Pipeline parallelism ({metrics['framework']} RPC, {metrics['steps']} steps)", rows
        )
    )


def run_worker(rank, world_size, args):
    global rpc, dist_autograd, DistributedOptimizer
    rpc, dist_autograd, DistributedOptimizer = rpc_framework(args.framework)
    torch.set_num_threads(1)  # one core per stage: the stages run side by side
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size)
        metrics = run_master(args)
        report(metrics, Path(args.out))
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["rrpc", "torch"], default="rrpc")
    parser.add_argument("--smoke", action="store_true", help="small model, 1 epoch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.batch_size, args.epochs = 256, 64, 1
    launch(run_worker, 3, args)


if __name__ == "__main__":
    main()
