"""A parameter server that trains an MLP on scikit-learn's handwritten digits.

Rank 0 is the parameter server: it holds the model, drives the epochs and, after
each one, measures accuracy on a held-out test split. Every other rank is a
trainer with its own disjoint shard of the training split. Two modes show the
two patterns of PyTorch's parameter-server tutorials:

- ``sync`` (distributed autograd): a trainer runs the forward pass *through the
  server's model* with ``ps_rref.rpc_sync().forward(x)`` inside a
  ``dist_autograd.context()``, runs ``dist_autograd.backward`` from its loss,
  and a ``DistributedOptimizer`` steps the parameters where they live, on the
  server. Trainers update the model asynchronously, each at its own pace.
- ``batched`` (``@rpc.functions.async_execution``): a trainer computes gradients
  on a local copy of the model and sends them to the server's
  ``update_and_fetch_model``, which waits until every trainer's gradients have
  arrived, steps once with their mean and answers all trainers with the new
  parameters through one shared Future.

Run (one command; it starts the server and the trainers on this machine):

    python examples/param_server/main.py                      # sync mode, 2 trainers
    python examples/param_server/main.py --mode batched
    python examples/param_server/main.py --framework torch    # the same on torch.distributed.rpc
    python examples/param_server/main.py --smoke              # a few seconds
    torchrun --nproc-per-node 3 examples/param_server/main.py # 1 server + 2 trainers
    RRPC_RESTRICTED=1 python examples/param_server/main.py    # peers run only what is exposed

It prints one line per epoch (train loss, test accuracy, samples/s) and a
summary, and writes metrics.json and curves.png to --out
(default: examples/param_server/out/).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn, optim

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import framework_from_argv, launch, plot, rpc_framework, summary, write_metrics  # noqa: E402

# `--framework torch` runs this same file on torch.distributed.rpc, the API rrpc mirrors.
rpc, dist_autograd, DistributedOptimizer = rpc_framework(framework_from_argv())
# rrpc's restricted mode (RRPC_RESTRICTED=1) runs only what a worker exposed;
# torch.distributed.rpc has no such mode, and there this is a no-op.
expose = getattr(rpc.functions, "expose", lambda obj: obj)
# The trainers get the run's settings as an argparse.Namespace.
expose(argparse.Namespace)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set (8x8 images, 10 classes), 75% train / 25% held-out test."""
    # Imported here: only the server loads the data (it sends each trainer its shard).
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=seed
    )
    # Standardize each pixel with the training split's statistics; the 0.1 keeps
    # the nearly constant border pixels from blowing up.
    mean, std = train_x.mean(dim=0), train_x.std(dim=0) + 0.1
    return (train_x - mean) / std, train_y, (test_x - mean) / std, test_y


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


# -- The parameter server (rank 0) ----------------------------------------------


@expose  # its public methods are called through RRef proxies
class ParameterServer:
    def __init__(self, args: argparse.Namespace, num_trainers: int):
        torch.manual_seed(args.seed)
        self.model = make_model(args.hidden)
        # batched mode: the server steps its own optimizer on the mean gradient.
        self.optimizer = optim.SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum)
        self.lock = threading.Lock()
        self.num_trainers = num_trainers
        self.arrived = 0
        self.future_parameters = torch.futures.Future()
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    # sync mode: trainers run the model here, inside their autograd context.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Trainers update the weights in place whenever they step, possibly before
        # another trainer's backward pass needs the weights its forward pass saw
        # (autograd would refuse). So each forward pass runs through its own copy:
        # the copy is part of the graph, so gradients still reach the parameters.
        weights = {name: p.clone() for name, p in self.model.named_parameters()}
        with self.lock:  # functional_call swaps the module's weights while it runs
            return torch.func.functional_call(self.model, weights, (x,))

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.model.parameters()]

    # batched mode
    def get_parameters(self) -> list[torch.Tensor]:
        with self.lock:
            return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    @expose  # called with rpc_sync, not through a proxy
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads: list[torch.Tensor]) -> torch.futures.Future:
        self = ps_rref.local_value()
        with self.lock:
            for p, grad in zip(self.model.parameters(), grads, strict=True):
                p.grad += grad
            self.arrived += 1
            # Keep this round's future: once it completes a new one replaces it.
            future = self.future_parameters
            if self.arrived == self.num_trainers:
                for p in self.model.parameters():
                    p.grad /= self.num_trainers
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.arrived = 0
                self.future_parameters = torch.futures.Future()
                # Answers every trainer waiting on this round.
                future.set_result([p.detach().clone() for p in self.model.parameters()])
        return future

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return (self.model(x).argmax(dim=1) == y).float().mean().item()


# -- A trainer (ranks 1..N) ------------------------------------------------------


@expose
class Trainer:
    """Lives on a trainer rank; the server drives it through an RRef."""

    def __init__(self, ps_rref, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace):
        self.ps_rref = ps_rref
        self.x, self.y = x, y  # this trainer's shard of the training split
        self.args = args
        self.generator = torch.Generator().manual_seed(args.seed + rpc.get_worker_info().id)
        if args.mode == "sync":
            # Steps the parameters on the server (with this trainer's own momentum).
            self.optimizer = DistributedOptimizer(
                optim.SGD,
                ps_rref.rpc_sync().parameter_rrefs(),
                lr=args.lr,
                momentum=args.momentum,
            )
        else:
            self.model = make_model(args.hidden)
            self.load(ps_rref.rpc_sync().get_parameters())

    def batches(self):
        order = torch.randperm(len(self.x), generator=self.generator)
        for start in range(0, len(order), self.args.batch_size):
            batch = order[start : start + self.args.batch_size]
            yield self.x[batch], self.y[batch]

    def train_epoch(self) -> tuple[float, int]:
        """One pass over this trainer's shard; returns (sum of losses, samples)."""
        step = self.step_sync if self.args.mode == "sync" else self.step_batched
        total_loss, samples = 0.0, 0
        for x, y in self.batches():
            total_loss += step(x, y) * len(y)
            samples += len(y)
        return total_loss, samples

    def shard_size(self) -> int:
        return len(self.y)

    def step_sync(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with dist_autograd.context() as context_id:
            output = self.ps_rref.rpc_sync().forward(x)
            loss = F.cross_entropy(output, y)
            dist_autograd.backward(context_id, [loss])
            self.optimizer.step(context_id)
        return loss.item()

    def step_batched(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        grads = [p.grad for p in self.model.parameters()]
        self.load(
            rpc.rpc_sync(
                self.ps_rref.owner(),
                ParameterServer.update_and_fetch_model,
                args=(self.ps_rref, grads),
            )
        )
        return loss.item()

    @torch.no_grad()
    def load(self, parameters: list[torch.Tensor]) -> None:
        for p, value in zip(self.model.parameters(), parameters, strict=True):
            p.copy_(value)


# -- Driving the training (on the server) ---------------------------------------


def run_server(num_trainers: int, args: argparse.Namespace) -> None:
    train_x, train_y, test_x, test_y = load_data(args.seed)
    server = ParameterServer(args, num_trainers)
    ps_rref = rpc.RRef(server)
    # Disjoint shards of equal size: in batched mode every trainer must send the
    # same number of updates, or the server would wait for a missing one.
    size = len(train_x) // num_trainers
    shards = zip(
        train_x[: size * num_trainers].chunk(num_trainers),
        train_y[: size * num_trainers].chunk(num_trainers),
        strict=True,
    )
    trainers = [
        rpc.remote(f"trainer{rank}", Trainer, args=(ps_rref, x.clone(), y.clone(), args))
        for rank, (x, y) in enumerate(shards, start=1)
    ]
    sizes = [t.rpc_sync().shard_size() for t in trainers]  # also waits until they are ready
    print(
        f"{args.framework}: parameter server + {num_trainers} trainers "
        f"({' + '.join(map(str, sizes))} training digits), mode {args.mode}, "
        f"{len(test_x)} held-out test digits",
        flush=True,
    )

    history: list[dict] = []
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        results = torch.futures.wait_all([t.rpc_async().train_epoch() for t in trainers])
        seconds = time.perf_counter() - epoch_start
        samples = sum(n for _, n in results)
        history.append(
            {
                "epoch": epoch,
                "train_loss": sum(loss for loss, _ in results) / samples,
                "test_accuracy": server.accuracy(test_x, test_y),
                "seconds": seconds,
                "samples_per_s": samples / seconds,
            }
        )
        h = history[-1]
        print(
            f"epoch {epoch:3d}/{args.epochs}  loss {h['train_loss']:.4f}  "
            f"test acc {h['test_accuracy']:.4f}  {h['samples_per_s']:7.0f} samples/s",
            flush=True,
        )
    training_seconds = time.perf_counter() - started

    out = Path(args.out)
    final = history[-1]["test_accuracy"]
    throughput = sum(h["samples_per_s"] for h in history) / len(history)
    metrics = {
        "example": "param_server",
        "framework": args.framework,
        "mode": args.mode,
        "restricted": args.restricted,
        "trainers": num_trainers,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "test_samples": len(test_x),
        "final_test_accuracy": final,
        "samples_per_s": throughput,
        "training_seconds": training_seconds,
        "wall_seconds": time.time() - args.launched_at,
        "history": history,
    }
    png = plot(
        str(out / "curves.png"),
        {
            "test accuracy": [h["test_accuracy"] for h in history],
            "train loss": [h["train_loss"] for h in history],
        },
        xlabel="epoch",
        ylabel="accuracy / loss",
        title=f"parameter server ({args.mode}, {num_trainers} trainers, {args.framework})",
    )
    metrics_path = write_metrics(str(out / "metrics.json"), metrics)
    print(
        summary(
            f"parameter server · {args.mode} · {args.framework}",
            {
                "trainers": num_trainers,
                "epochs": args.epochs,
                "test accuracy": f"{final:.4f} ({len(test_x)} held-out digits)",
                "training time": f"{training_seconds:.1f} s",
                "wall time": f"{metrics['wall_seconds']:.1f} s (incl. start-up)",
                "throughput": f"{throughput:.0f} samples/s (mean over epochs)",
                "metrics": metrics_path,
                "plot": png or "(matplotlib not installed)",
            },
        ),
        flush=True,
    )


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    name = "ps" if rank == 0 else f"trainer{rank}"
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        args.restricted = getattr(options, "restricted", False)
        run_server(world_size - 1, args)
    # Trainers only answer the server's calls; shutdown waits until everyone is done.
    rpc.shutdown()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["rrpc", "torch"], default="rrpc")
    parser.add_argument("--mode", choices=["sync", "batched"], default="sync")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few epochs, for tests")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args()
    if args.smoke:
        args.epochs = 4
    args.launched_at = time.time()
    return args


if __name__ == "__main__":
    args = parse_args()
    launch(main, args.trainers + 1, args)
