"""examples/ddp_rpc: DDP replicas stay identical while a remote embedding trains with them.

Runs the example as a user would (`python examples/ddp_rpc/main.py --smoke`)
and reads the outcome from its metrics file: every trainer's loss drops, and
the dense replicas the two DDP trainers end with are equal bit for bit.
"""

import json
import subprocess
from pathlib import Path

import pytest

from harness import run_script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_rpc" / "main.py"
# Seconds. A smoke run takes ~10 s on an idle 2-core machine; starting three
# processes that import torch takes far longer on a busy one.
TIMEOUT = 240


def run_example(*args: str) -> subprocess.CompletedProcess:
    return run_script(EXAMPLE, *args, timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize(
    "framework",
    ["rrpc", pytest.param("torch", marks=pytest.mark.slow)],
)
def test_smoke_run_loss_drops_and_ddp_replicas_stay_identical(framework, tmp_path):
    run = run_example("--smoke", "--framework", framework, "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:]

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["framework"], metrics["trainers"]) == (framework, 2)
    for trainer, first in metrics["first_loss"].items():
        assert metrics["final_loss"][trainer] < 0.5 * first, trainer
    assert metrics["loss_decreased"] is True
    assert metrics["replica_max_abs_diff"] == 0.0, run.stdout[-3000:]
    assert metrics["test_accuracy"] > 0.8
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert str(tmp_path / "metrics.json") in run.stdout
