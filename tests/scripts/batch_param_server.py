"""PyTorch's batch-updating parameter server tutorial, run under torchrun on
either framework (FRAMEWORK=rrpc or torch) with only the imports changed.

    FRAMEWORK=rrpc python -m torch.distributed.run --nproc-per-node 3 batch_param_server.py

Rank 0 serves a model; ranks 1 and 2 each take three steps, each step waiting
in an ``async_execution`` staticmethod of a class of this script until both
trainers' gradients are in. Rank 0 prints the weight sums the trainers ended
with: "RESULT [w1, w2]". The script's own classes and functions travel by
name, so the server runs them with its own state (its lock, its futures).
"""

import importlib
import os
import threading

import torch

rpc = importlib.import_module(
    "rrpc" if os.environ.get("FRAMEWORK", "rrpc") == "rrpc" else "torch.distributed.rpc"
)
TRAINERS = 2


class BatchUpdateParameterServer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads, strict=True):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= TRAINERS:
                for p in self.model.parameters():
                    p.grad /= TRAINERS
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def run_trainer(ps_rref):
    model = ps_rref.rpc_sync().get_model()
    for step in range(3):
        model(torch.full((2, 4), float(step + 1))).sum().backward()
        grads = [p.grad for p in model.parameters()]
        update = BatchUpdateParameterServer.update_and_fetch_model
        model = rpc.rpc_sync(ps_rref.owner(), update, args=(ps_rref, grads))
    return round(model.weight.sum().item(), 5)


def main():
    rank = int(os.environ["RANK"])
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=TRAINERS + 1)
    if rank == 0:
        ps_rref = rpc.RRef(BatchUpdateParameterServer())
        futures = [
            rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref,))
            for r in range(1, TRAINERS + 1)
        ]
        print("RESULT", [future.wait() for future in futures], flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
