"""Two nodes on one machine: network namespaces joined by a shaped veth pair (scripts/netns_cluster.sh).

Each node runs `shardwise train --parallel.nnodes 2 --parallel.rdzv_endpoint NODE0:PORT` in its own
namespace, as one would on every machine of a cluster; the runs must train exactly what the same layout
trains on one host (the reusable 4-rank gloo pool). Skipped, with the reason, where namespaces cannot be
made (not root, no iproute2, a sandbox without CAP_NET_ADMIN). The namespaces are always removed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint import list_checkpoints
from shardwise.train.state import open_checkpoint
from tests.test_train import make_config, run

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "netns_cluster.sh"
PREFIX = f"swt{os.getpid() % 100000}n"
"""Namespaces of this test session only (several sessions may share the machine)."""
SUBNET = "10.77.0"
ENDPOINT = f"{SUBNET}.1:29400"


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SW_NETNS_PREFIX": PREFIX, "SW_NETNS_SUBNET": SUBNET}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def cluster():
    """Two namespaces, node 0 at 10.77.0.1 and node 1 at 10.77.0.2, linked at 1 Gbit/s; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("multi-node tests make network namespaces (ip netns), which needs root; not root here")
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("multi-node tests need iproute2's ip and tc, which are not installed")
    try:
        up = _script("up")
        if up.returncode != 0:
            reason = (up.stderr.strip().splitlines() or ["unknown error"])[-1]
            pytest.skip(f"network namespaces are not allowed here: {reason}")
        yield [f"{PREFIX}0", f"{PREFIX}1"]
    finally:
        _script("down")


def _on_nodes(nodes: list[str], run_dir: Path, *extra: str, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """`shardwise train RUN_DIR/config.toml --parallel.nnodes 2 ...` in every namespace at once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardwise.cli", "train", str(run_dir / "config.toml"), "--parallel.nproc", "2",
           "--parallel.nnodes", "2", "--parallel.rdzv_endpoint", ENDPOINT, "--parallel.rdzv_timeout_s", "120",
           *extra]
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for ns in nodes]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _veth_bytes(ns: str) -> int:
    """Bytes node ``ns`` sent to the other node: the TX counter of its end of the veth pair."""
    path = f"/sys/class/net/swv{ns[-1]}/statistics/tx_bytes"  # ip netns exec mounts the namespace's /sys
    return int(subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True, text=True,
                              check=True).stdout)


AUTO = re.compile(r"comm\.algorithm=auto chose (\w+) for (\d+) B buckets")


@pytest.mark.parametrize("layout", [
    {"comm.algorithm": "hierarchical", "comm.node_size": 2},
    {"comm.algorithm": "auto", "model.d_model": 256},
    {"parallel.zero": 3, "parallel.zero_hpz": 2},
], ids=["dp-hierarchical", "dp-auto", "zero3-hpz"])
def test_two_nodes_train_what_one_host_trains(cluster, tmp_path, cache_dir, layout):
    """2 nodes x 2 ranks: the hierarchical all-reduce (tree inside a node, ring across), "auto" (the hierarchical
    one or the 2-D torus, rows inside a node and columns across; the torus alone is proven equal to the native
    all-reduce on one host in test_comm_collectives) and ZeRO-3 with its secondary partition inside a node
    (hpZ) give the final weights of the same layout on one host, bit for bit, and the traffic between
    the nodes crossed the shaped link. "auto" knows the nodes from the launcher's ranks per node,
    measures both link levels and picks a two-level algorithm for the gradient bucket (about 7 MB with
    d_model 256, where the 1 Gbit/s link makes the flat ring and gloo's own 25-40 % slower); the
    one-host reference runs the algorithm it picked."""
    overrides = {"train.steps": 3, **layout}
    run_dir = tmp_path / "two-nodes"
    make_config(run_dir, cache_dir, 4, **overrides)
    before = [_veth_bytes(ns) for ns in cluster]
    procs = _on_nodes(cluster, run_dir)
    for p in procs:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    sent = [_veth_bytes(ns) - b for ns, b in zip(cluster, before, strict=True)]
    assert min(sent) > 100_000, f"inter-node bytes {sent}: the ranks did not talk over the veth pair"
    if layout.get("comm.algorithm") == "auto":
        picks = AUTO.findall(procs[0].stdout + procs[0].stderr)
        assert picks, "no 'comm.algorithm=auto chose' line: " + procs[0].stdout[-2000:]
        assert {alg for alg, _ in picks} <= {"hierarchical", "torus"}, f"auto picked {picks} across 2 nodes"
        overrides.update({"comm.algorithm": picks[0][0], "comm.node_size": 2})
    _, reference, _ = run(tmp_path, cache_dir, "one-host", 4, **overrides)
    model = open_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1]).model_state()
    for name, value in reference.items():
        assert torch.equal(model[name], value), f"{name} differs from the one-host run"


def test_rendezvous_failures_are_one_line_within_the_timeout(cluster, tmp_path, cache_dir):
    """Node 1 alone: nobody serves the endpoint (unreachable). Node 0 alone: it hosts the rendezvous but
    parallel.nnodes=2 nodes never join. Both fail within parallel.rdzv_timeout_s (+ start-up), one line."""
    run_dir = tmp_path / "alone"
    make_config(run_dir, cache_dir, 4)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for ns in reversed(cluster):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "shardwise.cli", "train", str(run_dir / "config.toml"),
               "--parallel.nproc", "2", "--parallel.nnodes", "2", "--parallel.rdzv_endpoint", ENDPOINT,
               "--parallel.rdzv_timeout_s", "4"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        elapsed = time.monotonic() - t0
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "rendezvous at parallel.rdzv_endpoint=10.77.0.1:29400 failed" in lines[0], \
            proc.stderr[-2000:]
        assert "parallel.nnodes=2" in lines[0] and "Traceback" not in proc.stderr
        assert elapsed < 60, f"{ns}: took {elapsed:.0f} s to fail"
