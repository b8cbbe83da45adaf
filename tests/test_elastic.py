"""examples/elastic: a trainer killed mid-run is restarted by torchrun, rejoins, and
the run ends with the parameters of a run without failures.

The example's server hosts the store that torchrun's c10d rendezvous and the rrpc
group share, and starts ``torchrun --nnodes=1:3 --nproc-per-node=2
--max-restarts=3 --rdzv-backend=c10d`` for the trainers; ``--kill-trainer-at-step``
makes it SIGKILL trainer0's process at that step. Training is deterministic (the
server averages the shards of a step in shard order), so the summary compares the
final parameters with the same steps run in one process.
"""

import json
from pathlib import Path

import pytest

from harness import run_script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "elastic" / "main.py"
TIMEOUT = 200  # seconds: three torchrun start-ups of two trainers on a busy 2-core machine


@pytest.mark.timeout(TIMEOUT + 30)
def test_a_killed_trainer_is_restarted_rejoins_and_training_ends_as_without_failure(tmp_path):
    run = run_script(
        EXAMPLE, "--smoke", "--kill-trainer-at-step", "10", "--out", str(tmp_path),
        timeout=TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["killed_at_step"] == 10, run.stdout[-4000:]
    # torchrun restarted both local trainers; each rejoined under its name.
    rejoined = sorted(r["worker"] for r in metrics["restarts"])
    assert rejoined == ["trainer0", "trainer1"], run.stdout[-4000:]
    assert all(r["incarnation"] == 1 for r in metrics["restarts"])
    assert metrics["same_parameters_as_reference"] is True
    assert metrics["final_test_accuracy"] == metrics["reference_test_accuracy"]
    assert metrics["final_test_accuracy"] >= 0.9
    print(
        f"\nelastic: accuracy {metrics['final_test_accuracy']:.4f}; rejoined "
        + ", ".join(f"{r['worker']} {r['seconds_after_kill']:.1f} s" for r in metrics["restarts"])
        + " after the kill"
    )
