"""Many machines for real: the README's multi-node recipe across two network
namespaces joined by a veth pair (two "hosts", each with its own address), and
the Kubernetes manifest in deploy/ with the command it runs."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from harness import free_port, run_command

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import netns  # noqa: E402 -- benchmarks/netns.py: the veth pair the benchmark uses

RING = REPO / "tests" / "scripts" / "torchrun_ring.py"
MANIFEST = REPO / "deploy" / "k8s" / "param-server.yaml"
TIMEOUT = 150


def _env(**extra: str) -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.mark.timeout(TIMEOUT + 30)
def test_readme_multi_node_recipe_runs_across_two_hosts_joined_by_a_veth_pair():
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    with netns.VethPair.create() as pair:
        port = pair.a.free_port()
        before = sum(pair.link_bytes())
        outputs: dict[str, str] = {}
        failures: list[BaseException] = []

        def node(host: netns.Host, is_host: int) -> None:
            command = [
                "ip", "netns", "exec", host.netns,
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{pair.a.address}:{port}", "--rdzv-id", "two-hosts",
                "--rdzv-conf", f"is_host={is_host}", "--local-addr", host.address,
                str(RING),
            ]  # fmt: skip
            try:
                result = run_command(command, timeout=TIMEOUT, env=_env(), cwd=REPO)
                outputs[host.netns] = f"exit {result.returncode}\n{result.stdout}"
            except BaseException as error:
                failures.append(error)

        threads = [
            threading.Thread(target=node, args=(pair.a, 1)),
            threading.Thread(target=node, args=(pair.b, 0)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        crossed = sum(pair.link_bytes()) - before
    assert not failures, failures
    text = "\n".join(outputs.values())
    assert all(out.startswith("exit 0") for out in outputs.values()), text[-4000:]
    ring = sorted(line for line in text.splitlines() if line.startswith("RING "))
    assert ring == [
        f"RING rank={r} world=4 next=worker{(r + 1) % 4} sum={45 * r} self={100 + r} calls=[1, 2]"
        for r in range(4)
    ], text[-4000:]
    assert crossed > 10_000, f"only {crossed} bytes crossed the veth link"
    print(f"\ntwo hosts: {crossed} bytes crossed the veth link")


def test_kubernetes_manifest_is_an_indexed_job_behind_a_headless_service_and_its_command_runs(
    tmp_path,
):
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra) reads the manifest")
    service, job = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    [container] = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert int(env["NNODES"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    endpoint_host, endpoint_port = env["RDZV_ENDPOINT"].split(":")
    assert endpoint_host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(endpoint_port) == service["spec"]["ports"][0]["port"]
    assert env["RRPC_ADVERTISE_HOST"] == "$(POD_IP)"

    # The container's command, here: one node of three processes (a server, two trainers).
    command = container["command"] + container["args"]
    assert command[:2] == ["sh", "-c"] and "torch.distributed.run" in command[2]
    local = _env(
        NNODES="1", NPROC_PER_NODE="3", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
        POD_IP="127.0.0.1", RRPC_ADVERTISE_HOST="127.0.0.1", OUT=str(tmp_path),
    )  # fmt: skip
    local["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{local.get('PATH', '')}"
    result = run_command(command, timeout=TIMEOUT, env=local, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["trainers"] == 2
    assert metrics["final_test_accuracy"] >= 0.93, result.stdout[-4000:]
