"""Two nodes on one machine (network namespaces, a 1 Gbit/s tbf-shaped veth pair): what a two-level
network does to the collectives, ZeRO-3's hpZ and the planner.

    sudo python bench/bench_multinode.py --json bench/results/multinode.json --plot bench/results/multinode.png

Makes the namespaces with scripts/netns_cluster.sh (and always removes them), then measures

1. the links: one-direction TCP throughput and round-trip latency between the nodes (through the shaped
   veth pair) and inside a node (loopback), with plain sockets;
2. all-reduce of 1-64 MB on 2 nodes x 2 ranks: bus bandwidth (nccl-tests' busbw = algbw * 2(N-1)/N) of
   ring, hierarchical (ring inside a node, then across; node size 2), torus (2 x 2) and the backend's
   native one, and what comm.algorithm "auto" picks and how fast that is;
3. ZeRO-3 training on 2 x 2 ranks with hpZ off (zero_hpz=1) and on (zero_hpz=2): bytes that crossed
   between the nodes, read from the veth pair's counters (/sys/class/net/*/statistics, as `ip -s link`);
4. the planner (`shardwise plan --nodes 2 --gpus-per-node 2 --backend gloo`) fed with the links the cost
   model's calibration measured on the 2 x 2 group (step 2) and the compute rate of the cluster's four ranks
   computing alone at once (four single-rank runs on one rank's share of the batch each), against the
   measured step time of the two-node run, with its compute and communication parts beside the measured ones.

Needs root (CAP_NET_ADMIN). Timings on a machine shared with other work are noise: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.bench_result import BenchRun, add_machine_note

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "netns_cluster.sh"
PREFIX, SUBNET = f"swb{os.getpid() % 100000}n", "10.77.0"
NODES = [f"{PREFIX}0", f"{PREFIX}1"]
ADDR = [f"{SUBNET}.1", f"{SUBNET}.2"]
ALGORITHMS = ("native", "ring", "hierarchical", "torus")


def sh(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "SW_NETNS_PREFIX": PREFIX, "SW_NETNS_SUBNET": SUBNET}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=True, env=env, **kw)


def in_ns(node: int, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.Popen(["ip", "netns", "exec", NODES[node], *cmd], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def finish(procs: list[subprocess.Popen], timeout: float = 900) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:6])}... failed:\n{err[-3000:]}")
        outs.append(out)
    return outs


def tx_bytes(node: int) -> int:
    p = in_ns(node, ["cat", f"/sys/class/net/swv{node}/statistics/tx_bytes"])
    return int(finish([p])[0])


# ---- 1. links --------------------------------------------------------------------------------------------

_PROBE = r"""
import socket, sys, time
role, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(200):
        c.recv(1); c.sendall(b"x")
    got = 0
    while got < nbytes:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((host, port)); break
        except OSError:
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.perf_counter()
    for _ in range(200):
        c.sendall(b"x"); c.recv(1)
    rtt = (time.perf_counter() - t) / 200
    buf = b"\0" * (1 << 20); t = time.perf_counter()
    for _ in range(nbytes >> 20):
        c.sendall(buf)
    c.recv(1)
    print(rtt, nbytes / (time.perf_counter() - t))
"""


def probe(server_node: int, client_node: int, host: str, nbytes: int = 256 << 20) -> dict:
    """One-direction bytes/s and round-trip seconds from ``client_node`` to ``server_node``'s ``host``."""
    server = in_ns(server_node, [sys.executable, "-c", _PROBE, "server", host, "29555", str(nbytes)])
    client = in_ns(client_node, [sys.executable, "-c", _PROBE, "client", host, "29555", str(nbytes)])
    out = finish([client, server])[0]
    rtt, bw = map(float, out.split())
    return {"bytes_per_s": bw, "rtt_s": rtt}


# ---- 2. all-reduce ---------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank of the all-reduce benchmark (run inside a namespace)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardwise.dist.comm.bench import BUS_FACTOR, _auto_closure, _measure, parse_sizes, run_collective
    from shardwise.dist.comm.cost import calibrate

    torch.set_num_threads(1)
    rank, world = args.rank, 4
    store = dist.TCPStore(ADDR[0], 29501, world, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    sizes = parse_sizes(args.sizes)
    model = calibrate(large=max(sizes), collectives=("all_reduce",), local_world_size=2)
    rows = []
    for size in sizes:
        fns = [run_collective("all_reduce", a, size, None, world) for a in ALGORITHMS]
        auto, pick = _auto_closure("all_reduce", size, model, world, local_world_size=2)  # 2 ranks per node
        times, _ = _measure([*fns, auto], args.reps, None)  # best times (the paired ratio is not used here)
        for name, t in zip([*ALGORITHMS, "auto"], times, strict=True):
            algbw = size / t / 1e9
            chosen = pick() if name == "auto" else name
            rows.append({"size": size, "algorithm": name, "chosen": chosen, "time_s": t,
                         "predicted_s": model.predict("all_reduce", chosen, size, node_size=2),
                         "busbw_GBps": algbw * BUS_FACTOR["all_reduce"](world)})
    if rank == 0:
        lv = model.levels
        print(json.dumps({"rows": rows, "model": {
            "alpha_intra_s": lv.alpha_intra, "beta_intra_s_per_byte": lv.beta_intra, "alpha_inter_s": lv.alpha_inter,
            "beta_flow_s_per_byte": lv.beta_flow, "beta_node_s_per_byte": lv.beta_node,
            "margin_at": {str(s): model.margin_at(s) for s in sizes},
            "efficiency": list(model.efficiency), "overhead_s": model.overhead}}))
    dist.barrier()
    dist.destroy_process_group()


def latency_worker(args: argparse.Namespace) -> None:
    """One rank of the call-latency measurement: compute bursts of ``args.latency`` seconds (single-threaded
    matmuls, all four ranks at once) with and without a small all-reduce after each; the difference per
    burst is what one synchronisation costs ranks that compute between collectives."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = args.rank, 4
    store = dist.TCPStore(ADDR[0], 29501, world, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    x, flag = torch.randn(128, 128), torch.zeros(2)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(100):
        torch.mm(x, x)
    k = max(1, round(args.latency / ((time.perf_counter() - t0) / 100)))  # matmuls per burst, all ranks busy
    k = int(max(_agree_max([k])))

    def loop(sync: bool) -> float:
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.reps * 10):
            for _ in range(k):
                torch.mm(x, x)
            if sync:
                dist.all_reduce(flag)
        return (time.perf_counter() - t) / (args.reps * 10)

    samples = [loop(True) - loop(False) for _ in range(3)]
    out = _agree_max([statistics.median(samples)])[0]
    if rank == 0:
        print(json.dumps({"call_latency_s": out, "burst_s": args.latency}))
    dist.barrier()
    dist.destroy_process_group()


def _agree_max(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def call_latency(burst_s: float, reps: int) -> float:
    procs = [in_ns(rank // 2, [sys.executable, __file__, "--latency", str(burst_s), "--worker", str(rank), "--reps",
                               str(reps)], env={"GLOO_SOCKET_IFNAME": f"swv{rank // 2}"}) for rank in range(4)]
    return json.loads(finish(procs)[0])["call_latency_s"]


def all_reduce_table(sizes: str, reps: int) -> dict:
    """``{"rows": [...], "model": {...}}``: per size and algorithm the measured and predicted seconds, and the
    two-level constants the calibration measured (its own calibration at the largest size)."""
    procs = []
    for rank in range(4):
        node = rank // 2
        procs.append(in_ns(node, [sys.executable, __file__, "--worker", str(rank), "--sizes", sizes,
                                  "--reps", str(reps)], env={"GLOO_SOCKET_IFNAME": f"swv{node}"}))
    return json.loads(finish(procs)[0])


# ---- 3. and 4. training -------------------------------------------------------------------------------------

TRAIN = ["--model.preset", "tiny", "--data.max_bytes", "400000", "--data.seq_len", "64", "--train.global_batch", "16",
         "--train.eval_every", "0", "--ckpt.every", "0", "--run.progress", "false", "--run.tensorboard", "false",
         "--parallel.zero", "3"]


def train(tmp: Path, name: str, nodes: int, steps: int, *extra: str) -> tuple[list[dict], list[int]]:
    """A ZeRO-3 run on ``nodes`` namespace nodes x 2 ranks; its metrics and each node's veth TX bytes."""
    run_dir = tmp / name
    args = [sys.executable, "-m", "shardwise.cli", "train", *TRAIN, "--train.steps", str(steps),
            "--parallel.nproc", "2", "--run.dir", str(run_dir), "--data.cache_dir", str(tmp / "cache"), *extra]
    if nodes > 1:
        args += ["--parallel.nnodes", str(nodes), "--parallel.rdzv_endpoint", f"{ADDR[0]}:29400"]
    before = [tx_bytes(n) for n in range(2)]
    finish([in_ns(n, args) for n in range(nodes)])
    sent = [tx_bytes(n) - b for n, b in zip(range(2), before, strict=True)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "loss" in r], sent


def solo_runs(tmp: Path, steps: int) -> list[list[dict]]:
    """The compute alone, as the cluster's ranks do it: one single-rank run per rank of the 2 x 2 cluster,
    all four at once (each in its node's namespace), each on one rank's share of the global batch, no
    communication. Four processes on this machine's cores, as in the two-node run."""
    procs, world = [], 4
    batch = int(TRAIN[TRAIN.index("--train.global_batch") + 1]) // world
    for i in range(world):
        args = [sys.executable, "-m", "shardwise.cli", "train", *TRAIN, "--parallel.zero", "0",
                "--train.global_batch", str(batch), "--train.micro_batch", str(batch), "--train.steps", str(steps),
                "--parallel.nproc", "1", "--run.dir", str(tmp / f"solo{i}"), "--data.cache_dir", str(tmp / "cache")]
        procs.append(in_ns(i // 2, args))
    finish(procs)
    runs = []
    for i in range(world):
        lines = (tmp / f"solo{i}" / "metrics.jsonl").read_text().splitlines()
        runs.append([r for r in (json.loads(line) for line in lines if line.strip()) if "loss" in r])
    return runs


def achieved_flops_per_rank(run_dir: Path, runs: list[list[dict]]) -> float:
    """FLOP/s one rank reaches computing alone while the other ranks of the cluster compute too (the median
    over the runs of each run's median past warm-up): the compute rate the planner is given."""
    from shardwise.config import Config
    from shardwise.train.flops import training_flops_per_token

    cfg = Config.load(str(run_dir / "config.toml"))
    fpt = training_flops_per_token(cfg.model, cfg.data.seq_len)
    return statistics.median(statistics.median(r["tokens_per_s"] for r in recs[2:]) for recs in runs) * fpt


def plan_step_time(tmp: Path, model: dict, flops_per_rank: float, overlap: float, latency: float = 0.0) -> dict:
    """The planner's step time for the two-node ZeRO-3 layout, fed with the links the cost model's calibration
    measured on the running 2 x 2 group (gloo's per-message latency and each level's bandwidth: one flow, and
    the node's link shared by its ranks) and the measured compute rate; its compute and communication parts."""
    hw = tmp / "measured.toml"
    tflops = flops_per_rank / 1e12
    hw.write_text(
        "[gpu.netns-cpu]\n"
        f"fp32_tflops = {tflops}\nbf16_tflops = {tflops}\nmemory_gb = 16\n"
        f"nvlink_gbps = {2 / model['beta_intra_s_per_byte'] / 1e9}\n"
        f"network_gbit = {8 / model['beta_flow_s_per_byte'] / 1e9}\n"
        f"node_network_gbit = {8 / model['beta_node_s_per_byte'] / 1e9}\n"
        f"intra_latency_us = {model['alpha_intra_s'] * 1e6}\n"
        f"inter_latency_us = {model['alpha_inter_s'] * 1e6}\n")
    cfg = tmp / "hpz1" / "config.toml"
    cmd = [sys.executable, "-m", "shardwise.cli", "plan", str(cfg), "--nodes", "2", "--gpus-per-node", "2",
           "--gpu", "netns-cpu", "--hardware", str(hw), "--efficiency", "1", "--backend", "gloo",
           "--overlap", str(overlap), "--call-latency-us", str(latency * 1e6), "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)["layouts"][0]
    t = out["time"]
    return {"step_time_s": t["step_time_s"], "compute_s": t["compute_s"], "comm_exposed_s": t["comm_exposed_s"],
            "comm_s": sum(c["time_s"] for c in out["comm"]), "sync_s": t["sync_s"],
            "collectives_per_step": t["collectives_per_step"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,4M,16M,64M")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of the link between the nodes")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--latency", type=float, help=argparse.SUPPRESS)
    add_machine_note(p)
    args = p.parse_args(argv)
    if args.worker is not None:
        args.rank = args.worker
        latency_worker(args) if args.latency else worker(args)
        return 0
    if os.geteuid() != 0:
        print("error: bench_multinode makes network namespaces, which needs root", file=sys.stderr)
        return 2
    bench_run = BenchRun.start(__file__, argv, args, output=args.json)
    result: dict = {"rate": args.rate}
    try:
        sh("up", args.rate)
        result["links"] = {"inter": probe(1, 0, ADDR[1]), "intra": probe(0, 0, "127.0.0.1")}
        table = all_reduce_table(args.sizes, args.reps)
        result["all_reduce"], result["cost_model"] = table["rows"], table["model"]
        with tempfile.TemporaryDirectory() as t:
            tmp = Path(t)
            runs = {hpz: train(tmp, f"hpz{hpz}", 2, args.steps, "--parallel.zero_hpz", str(hpz)) for hpz in (1, 2)}
            med = lambda recs, k: statistics.median(r[k] for r in recs[2:])  # noqa: E731 - past warm-up
            result["zero3_inter_node_bytes_per_step"] = {
                f"hpz{h}": {"veth_tx_bytes": sum(sent) / args.steps, "step_time_s": med(recs, "step_time_s")}
                for h, (recs, sent) in runs.items()}
            solo = solo_runs(tmp, args.steps)
            achieved = achieved_flops_per_rank(tmp / "hpz1", solo)
            # comm hides behind compute only if a core is free to drive it: here 4 ranks share the machine's cores
            overlap = 1.0 if (os.cpu_count() or 1) > 4 else 0.0
            compute = statistics.median(med(recs, "step_time_s") for recs in solo)
            # one synchronisation's cost, measured between compute bursts as long as the step's compute between calls
            calls = plan_step_time(tmp, result["cost_model"], achieved, overlap)["collectives_per_step"]
            latency = call_latency(compute / calls, args.reps)
            plan = plan_step_time(tmp, result["cost_model"], achieved, overlap, latency)
            measured = result["zero3_inter_node_bytes_per_step"]["hpz1"]["step_time_s"]
            result["planner"] = {
                "flops_per_rank_all_ranks_busy": achieved, "overlap": overlap, "predicted_step_time_s":
                plan["step_time_s"], "measured_step_time_s": measured, "error": plan["step_time_s"] / measured - 1,
                "predicted_compute_s": plan["compute_s"], "measured_compute_alone_s": compute,
                "predicted_comm_s": plan["comm_s"], "predicted_comm_exposed_s": plan["comm_exposed_s"],
                "call_latency_s": latency, "collectives_per_step": calls, "predicted_sync_s": plan["sync_s"],
                "measured_step_minus_compute_s": measured - compute,
                "predicted_step_time_if_hidden_s": plan_step_time(tmp, result["cost_model"], achieved, 1.0,
                                                                  latency)["step_time_s"]}
    finally:
        sh("down")
    print(report(result))
    if args.json:
        bench_run.write(args.json, result)
    return 0


def report(r: dict) -> str:
    inter, intra = r["links"]["inter"], r["links"]["intra"]
    lines = [f"links: inter-node {inter['bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, rtt {inter['rtt_s'] * 1e6:.0f} us; "
             f"intra-node {intra['bytes_per_s'] * 8 / 1e9:.1f} Gbit/s, rtt {intra['rtt_s'] * 1e6:.0f} us",
             f"{'size':>6} " + " ".join(f"{a:>13}" for a in (*ALGORITHMS, "auto")) + "  (busbw GB/s; auto's pick)"]
    sizes = sorted({row["size"] for row in r["all_reduce"]})
    for size in sizes:
        rows = {row["algorithm"]: row for row in r["all_reduce"] if row["size"] == size}
        cells = [f"{rows[a]['busbw_GBps']:13.3f}" for a in ALGORITHMS]
        best = max(rows[a]["busbw_GBps"] for a in ALGORITHMS)
        auto = rows["auto"]
        lines.append(f"{size >> 20:>5}M " + " ".join(cells) + f" {auto['busbw_GBps']:13.3f}  {auto['chosen']} "
                     f"({auto['busbw_GBps'] / best:.0%} of the best)")
    for k, v in r.get("zero3_inter_node_bytes_per_step", {}).items():
        lines.append(f"ZeRO-3 {k}: {v['veth_tx_bytes'] / 1e6:.2f} MB/step across the nodes, "
                     f"step {v['step_time_s']:.3f} s")
    if "planner" in r:
        pl = r["planner"]
        lines.append(f"planner: predicted {pl['predicted_step_time_s']:.3f} s/step, measured "
                     f"{pl['measured_step_time_s']:.3f} s ({pl['error']:+.0%})")
        lines.append(f"  compute {pl['predicted_compute_s']:.3f} s predicted / {pl['measured_compute_alone_s']:.3f} s "
                     f"measured alone; communication {pl['predicted_comm_s']:.3f} s + sync {pl['predicted_sync_s']:.3f}"
                     f" s ({pl['collectives_per_step']} calls x {pl['call_latency_s'] * 1e3:.2f} ms) predicted / "
                     f"{pl['measured_step_minus_compute_s']:.3f} s measured (step - compute)")
        lines.append(f"  {pl['predicted_step_time_if_hidden_s']:.3f} s/step predicted if communication hid")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
