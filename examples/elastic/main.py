"""Elastic training: a parameter server whose trainers torchrun restarts when they die.

The parameter server (``ps``) is a long-lived process outside torchrun. It
hosts the store that everything rendezvous through (a plain
``torch.distributed.TCPStore``), and torchrun's c10d rendezvous uses the same
store as its endpoint. The trainers run under torchrun, elastic:

    torchrun --nnodes=1:3 --nproc-per-node=2 --max-restarts=3 \\
             --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=digits \\
             --rdzv-conf=last_call_timeout=1 \\
             examples/elastic/main.py trainer --store HOST:PORT

Every rrpc worker joins one dynamic rrpc group (no world size) on that store:
``ps`` as rank 0, trainer ``trainer<RANK>`` as rank 1 + RANK. Training pulls
work from the server: each step of SGD (momentum 0.9) on scikit-learn's digits
is cut into ``--shards`` shards; a trainer asks ``ps`` for a shard
(``next_work``), computes that shard's gradient with the parameters it got,
and sends it back (``submit``). Once every shard of a step is in, the server
averages them in shard order and steps. A shard leased to a trainer that died
goes to another one when its successor under that name asks for work (or after
``LEASE`` seconds). So the result does not depend on who computed what, nor on
failures: a run in which a trainer is killed ends with the very parameters of
a run without one (the summary checks it against ``reference``, the same
steps in one process).

When a trainer dies, torchrun stops its other local workers and starts them
all again (``--max-restarts``); they rejoin the group under their names and
pull work from the step the server is at.

Run (one command: the server here, the trainers under torchrun):

    python examples/elastic/main.py                          # 2 trainers, 3 epochs
    python examples/elastic/main.py --kill-trainer-at-step 20 # SIGKILL trainer0 at step 20
    python examples/elastic/main.py --smoke                  # a few seconds of training

or by hand, the server and torchrun in two terminals:

    python examples/elastic/main.py server --store 0.0.0.0:29400 --trainers-started-by-hand
    torchrun --nnodes=1:3 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \\
             --rdzv-endpoint=SERVER:29400 --rdzv-id=digits \\
             examples/elastic/main.py trainer --store SERVER:29400

It prints progress, the restarts it saw and a summary, and writes metrics.json
to --out (default: examples/elastic/out/).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import free_port, summary, write_metrics  # noqa: E402

import rrpc  # noqa: E402

LEASE = 30.0  # seconds a trainer may hold a shard before it goes to another
KILL_WAIT = 60.0  # seconds the kill step waits for trainer0 to show up


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set (8x8 images, 10 classes), 75% train / 25% test, standardized."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=seed
    )
    mean, std = train_x.mean(dim=0), train_x.std(dim=0) + 0.1
    return (train_x - mean) / std, train_y, (test_x - mean) / std, test_y


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def schedule(args: argparse.Namespace, samples: int) -> list[torch.Tensor]:
    """The sample indices of every step: ``epochs`` shuffled passes, in batches."""
    generator = torch.Generator().manual_seed(args.seed)
    steps = []
    for _ in range(args.epochs):
        order = torch.randperm(samples, generator=generator)
        for start in range(0, samples - args.batch_size + 1, args.batch_size):
            steps.append(order[start : start + args.batch_size])
    return steps


def shard_gradient(
    model: nn.Module, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """The gradient of the mean loss over one shard, at ``params``."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(value)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def apply_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, grads: list[list[torch.Tensor]]
) -> None:
    """Average the shards' gradients in shard order and step."""
    for i, p in enumerate(model.parameters()):
        total = grads[0][i].clone()
        for shard in grads[1:]:
            total += shard[i]
        p.grad = total / len(grads)
    optimizer.step()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def reference(args: argparse.Namespace) -> nn.Module:
    """The same training in one process, without RPC: what the elastic run must match."""
    torch.set_num_threads(1)
    train_x, train_y, _, _ = load_data(args.seed)
    model, worker_model = make_model(args.seed), make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for batch in schedule(args, len(train_x)):
        params = [p.detach().clone() for p in model.parameters()]
        grads = [
            shard_gradient(worker_model, params, train_x[shard], train_y[shard])
            for shard in batch.chunk(args.shards)
        ]
        apply_step(model, optimizer, grads)
    return model


# -- The parameter server ------------------------------------------------------------


class Server:
    """The model, the step it is at, and who holds which shard of that step."""

    def __init__(self, args: argparse.Namespace):
        torch.set_num_threads(1)
        self.args = args
        self.train_x, self.train_y, self.test_x, self.test_y = load_data(args.seed)
        self.model = make_model(args.seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.steps = schedule(args, len(self.train_x))
        self.step = 0
        self.cond = threading.Condition()
        self.grads: dict[int, list[torch.Tensor]] = {}  # shard -> gradient, this step
        self.leases: dict[int, tuple[str, int, float]] = {}  # shard -> (name, pid, since)
        self.pids: dict[str, int] = {}  # trainer name -> the pid of its live process
        self.history: list[dict] = []
        self.restarts: list[dict] = []
        self.kill_at = args.kill_trainer_at_step
        self.killed_at: float | None = None
        self.kill_waiting_since: float | None = None
        self.killed_at_step: int | None = None
        self.started = time.perf_counter()

    def next_work(self, name: str, pid: int) -> tuple | None:
        """A shard to compute: (step, shard, its indices, the parameters); None: done."""
        with self.cond:
            if self.pids.get(name) != pid:
                # A new process under this name: its predecessor died, and its
                # shards go back to the pool.
                for shard, (holder, _, _) in list(self.leases.items()):
                    if holder == name:
                        del self.leases[shard]
                self.pids[name] = pid
            while True:
                self.kill_if_due()
                if self.pids.get(name) != pid:
                    return None  # this call came from a process that was replaced
                if self.step == len(self.steps):
                    return None
                now = time.monotonic()
                if self.waiting_for_trainer0(now):
                    self.cond.wait(1.0)
                    continue
                for shard, (_, _, since) in list(self.leases.items()):
                    if now - since > LEASE:
                        del self.leases[shard]
                free = [
                    shard
                    for shard in range(self.args.shards)
                    if shard not in self.grads and shard not in self.leases
                ]
                if free:
                    shard = free[0]
                    self.leases[shard] = (name, pid, now)
                    indices = self.steps[self.step].chunk(self.args.shards)[shard]
                    params = [p.detach().clone() for p in self.model.parameters()]
                    return self.step, shard, indices, params
                self.cond.wait(1.0)

    def submit(self, name: str, pid: int, step: int, shard: int, grad: list) -> None:
        with self.cond:
            if step != self.step or shard in self.grads or self.pids.get(name) != pid:
                return  # late: another trainer computed it already
            self.leases.pop(shard, None)
            self.grads[shard] = grad
            if len(self.grads) < self.args.shards:
                return
            apply_step(self.model, self.optimizer, [self.grads[s] for s in sorted(self.grads)])
            self.grads.clear()
            self.step += 1
            if self.step % self.args.steps_per_epoch == 0 or self.step == len(self.steps):
                self.record_epoch()
            self.kill_if_due()
            self.cond.notify_all()

    def waiting_for_trainer0(self, now: float) -> bool:
        """Whether the kill step holds work back until trainer0 shows up: the
        other trainer may start first and, on a busy machine, would otherwise
        run every step alone before trainer0 asks for one (under ``cond``)."""
        if not self.kill_at or self.killed_at is not None or self.step < self.kill_at:
            return False
        if "trainer0" in self.pids:
            return False
        if self.kill_waiting_since is None:
            self.kill_waiting_since = now
            print(f"step {self.step}: waiting for trainer0 to kill it", flush=True)
        return now - self.kill_waiting_since < KILL_WAIT

    def kill_if_due(self) -> None:
        """SIGKILL trainer0, once: at the kill step, or as soon as it shows up
        after it (under ``cond``)."""
        if not self.kill_at or self.killed_at is not None or self.step < self.kill_at:
            return
        pid = self.pids.get("trainer0")
        if pid is None:
            return
        self.killed_at, self.killed_at_step = time.monotonic(), self.step
        print(f"step {self.step}: killing trainer0 (pid {pid}) with SIGKILL", flush=True)
        os.kill(pid, signal.SIGKILL)

    def record_epoch(self) -> None:
        epoch = len(self.history) + 1
        self.history.append(
            {
                "epoch": epoch,
                "step": self.step,
                "test_accuracy": accuracy(self.model, self.test_x, self.test_y),
                "seconds": time.perf_counter() - self.started,
            }
        )
        h = self.history[-1]
        print(f"epoch {epoch}: step {h['step']:4d}  test acc {h['test_accuracy']:.4f}", flush=True)

    def on_membership_change(self, event: rrpc.MembershipEvent) -> None:
        if event.kind == "joined" and event.incarnation > 0:
            with self.cond:
                step = self.step
            after = time.monotonic() - self.killed_at if self.killed_at is not None else None
            self.restarts.append(
                {
                    "worker": event.worker.name,
                    "incarnation": event.incarnation,
                    "step": step,
                    "seconds_after_kill": after,
                }
            )
            seen = f", {after:.1f} s after the kill" if after is not None else ""
            print(
                f"step {step}: {event.worker.name} rejoined (incarnation "
                f"{event.incarnation}){seen}",
                flush=True,
            )


_server: Server | None = None


def next_work(name: str, pid: int) -> tuple | None:
    assert _server is not None
    return _server.next_work(name, pid)


def submit(name: str, pid: int, step: int, shard: int, grad: list) -> None:
    assert _server is not None
    _server.submit(name, pid, step, shard, grad)


def run_server(args: argparse.Namespace) -> int:
    global _server
    host, port = args.store.rsplit(":", 1) if args.store else ("127.0.0.1", str(free_port()))
    # The store of everything: torchrun's c10d rendezvous and the rrpc group.
    store = dist.TCPStore(
        host, int(port), is_master=True, wait_for_workers=False, multi_tenant=True,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    _server = server = Server(args)
    server_host = "127.0.0.1" if host in ("0.0.0.0", "127.0.0.1") else host
    endpoint = f"{server_host}:{port}"
    rrpc.on_membership_change(server.on_membership_change)
    rrpc.init_rpc(
        "ps",
        rank=0,
        rpc_backend_options=rrpc.RpcBackendOptions(init_method=f"tcp://{endpoint}"),
    )
    print(
        f"parameter server: {len(server.steps)} steps of {args.batch_size} digits in "
        f"{args.shards} shards, store at {endpoint}",
        flush=True,
    )
    torchrun = None
    if not args.trainers_started_by_hand:
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=1:3", f"--nproc-per-node={args.trainers}", "--max-restarts=3",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=digits",
            # With a range of nodes, a rendezvous round waits last_call_timeout
            # (30 s by default) for more nodes once it has the minimum.
            "--monitor-interval=0.2", "--rdzv-conf=last_call_timeout=1",
            __file__, "trainer", "--store", endpoint,
        ]  # fmt: skip
        repo = str(Path(__file__).resolve().parents[2])  # rrpc, for a checkout not installed
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        }
        torchrun = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        with server.cond:
            while server.step < len(server.steps):
                if torchrun is not None and torchrun.poll() is not None:
                    raise SystemExit(f"torchrun ended (exit code {torchrun.returncode}) early")
                server.cond.wait(1.0)
        if torchrun is not None:
            code = torchrun.wait(120)
            if code != 0:
                raise SystemExit(f"torchrun ended with exit code {code}")
    finally:
        if torchrun is not None and torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
    rrpc.shutdown()
    del store
    return report(server, args)


def report(server: Server, args: argparse.Namespace) -> int:
    expected = reference(args)
    same = all(
        torch.equal(a, b)
        for a, b in zip(server.model.parameters(), expected.parameters(), strict=True)
    )
    final = server.history[-1]["test_accuracy"]
    expected_accuracy = accuracy(expected, server.test_x, server.test_y)
    metrics = {
        "example": "elastic",
        "trainers": args.trainers,
        "steps": len(server.steps),
        "shards": args.shards,
        "final_test_accuracy": final,
        "reference_test_accuracy": expected_accuracy,
        "same_parameters_as_reference": same,
        "killed_at_step": server.killed_at_step,
        "restarts": server.restarts,
        "history": server.history,
    }
    path = write_metrics(str(Path(args.out) / "metrics.json"), metrics)
    rejoin = ", ".join(
        f"{r['worker']} at step {r['step']}"
        + (f" ({r['seconds_after_kill']:.1f} s after the kill)" if r["seconds_after_kill"] else "")
        for r in server.restarts
    )
    print(
        summary(
            "elastic parameter server",
            {
                "trainers": f"{args.trainers} under torchrun (--max-restarts=3)",
                "steps": len(server.steps),
                "test accuracy": f"{final:.4f}",
                "one process": f"{expected_accuracy:.4f} (same parameters: {same})",
                "rejoined": rejoin or "none",
                "metrics": path,
            },
        ),
        flush=True,
    )
    return 0 if same else 1


# -- A trainer (under torchrun) ---------------------------------------------------------


def run_trainer(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    # When one trainer dies, torchrun stops the others with SIGTERM and waits up
    # to 30 s before SIGKILL; leave at once, so that the restart comes sooner.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    rank = int(os.environ["RANK"])
    # torchrun sets WORLD_SIZE for its own world; the rrpc group is dynamic.
    os.environ.pop("WORLD_SIZE", None)
    name, pid = f"trainer{rank}", os.getpid()
    rrpc.init_rpc(
        name,
        rank=1 + rank,
        rpc_backend_options=rrpc.RpcBackendOptions(init_method=f"tcp://{args.store}"),
    )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"{name} (pid {pid}, restart {restart}) joined", flush=True)
    train_x, train_y, _, _ = load_data(args.seed)
    model = make_model(args.seed)
    while (work := rrpc.rpc_sync("ps", next_work, args=(name, pid), timeout=0)) is not None:
        step, shard, indices, params = work
        grad = shard_gradient(model, params, train_x[indices], train_y[indices])
        rrpc.rpc_sync("ps", submit, args=(name, pid, step, shard, grad))
    rrpc.shutdown()
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", choices=["server", "trainer"], default="server")
    parser.add_argument("--store", default="", help="HOST:PORT of the store (server: to host)")
    parser.add_argument("--trainers", type=int, default=2, help="--nproc-per-node of torchrun")
    parser.add_argument("--trainers-started-by-hand", action="store_true")
    parser.add_argument("--kill-trainer-at-step", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 epochs, for tests")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args()
    if args.smoke:
        args.epochs = 2
    args.steps_per_epoch = 1347 // args.batch_size  # digits: 1347 training samples
    return args


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(run_trainer(arguments) if arguments.role == "trainer" else run_server(arguments))
