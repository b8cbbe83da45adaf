"""examples/pipeline: a model pipelined over RPC trains exactly like the same model in one process.

Runs the example as a user would (`python examples/pipeline/main.py --smoke`)
and reads the outcome from its metrics file.
"""

import json
import subprocess
from pathlib import Path

import pytest

from harness import run_script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipeline" / "main.py"
TIMEOUT = 100  # seconds; the run takes ~20 s on an idle 2-core machine


def run_example(*args: str) -> subprocess.CompletedProcess:
    return run_script(EXAMPLE, *args, timeout=TIMEOUT)


@pytest.mark.parametrize("framework", ["rrpc", pytest.param("torch", marks=pytest.mark.slow)])
def test_smoke_run_loss_equals_one_process_training_for_every_micro_batch_count(
    framework, tmp_path
):
    run = run_example("--smoke", "--framework", framework, "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:]

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["framework"] == framework
    local = metrics["local_losses"]
    assert len(local) == metrics["steps"] > 1
    assert local[-1] < local[0]  # it trains
    assert sorted(metrics["micro_batches"], key=int) == ["1", "2", "4", "8"]
    for count, run_metrics in metrics["micro_batches"].items():
        losses = run_metrics["losses"]
        assert len(losses) == len(local), f"{count} micro-batches"
        for step, (distributed, one_process) in enumerate(zip(losses, local, strict=True)):
            assert distributed == pytest.approx(one_process, abs=1e-5), (
                f"{count} micro-batches, step {step}"
            )
        assert run_metrics["samples_per_s"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert str(tmp_path / "metrics.json") in run.stdout
