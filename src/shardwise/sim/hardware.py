"""The simulated cluster: a GPU type with its roofline efficiencies, nodes of GPUs behind NVLink / NVSwitch,
one NIC per GPU on its own rail (rail-optimised), a two-tier fat tree with an oversubscription ratio, and
the storage a checkpoint is written to.

The GPU's peak FLOP/s, memory, NVLink and NIC bandwidths and latencies come from the planner's catalogue
(:mod:`shardwise.plan.hardware`, the vendors' data sheets); what the simulator adds is read from the
``[sim]`` table of a ``--hardware`` TOML file, every field optional (the same file may hold the planner's
``[gpu.NAME]`` tables, so one file describes a machine to both commands):

==========================  ===========================================================================
``hbm_gbps``                device memory bandwidth, GB/s (default: the data sheet of the built-in GPU)
``matmul_efficiency``       fraction of peak FLOP/s a matrix multiplication reaches when its tiles fill every SM
                            (default: the GPU's measured maximum achievable matmul FLOP/s, :data:`MAMF`; 0.70
                            for a GPU without one); with ``sms`` > 0 the tile model scales it per shape
``sms``                     streaming multiprocessors of the GPU (default: the data sheet's, :data:`SMS`; 0 =
                            no tile model: every matrix product at ``matmul_efficiency``), see
                            :mod:`shardwise.sim.matmul`
``attention_efficiency``    fraction of peak a fused (flash) attention kernel reaches (default 0.50:
                            FlashAttention-2 reaches 50-73 % of an A100's peak forward, Dao 2023, abstract)
``memory_efficiency``       fraction of ``hbm_gbps`` a memory-bound kernel reaches (default 0.80)
``kernel_overhead_us``      fixed cost of every operator (launch, dispatch), microseconds (default 0)
``step_overhead_ms``        fixed cost of every optimizer step outside the model (data, metrics; default 0)
``call_latency_us``         cost of every collective call beyond its messages (default 0 on GPUs)
``attention``               "flash" (fused, O(s) memory traffic; default) or "eager" (scores in memory)
``overlap``                 whether communication runs beside computation (default true: a GPU's copy
                            engines and NICs); false for CPU ranks whose cores all compute -- a collective
                            then takes the cores, and every transfer blocks the rank's computation
``network_overlap``         whether a collective whose groups span nodes runs beside computation even where
                            ``overlap`` is false (default true): its messages cross a NIC, which paces them
                            while the sending cores compute (gloo's I/O threads post them; measured between
                            this machine's namespaces over the 1 Gbit/s link: 4 ranks' direct exchange of
                            6 MiB blocks, 208-309 ms alone, beside 332-368 ms of matrix products took
                            368-400 ms, not their sum); a call the engine waits for at once still blocks
``backend``                 "nccl" (default) or "gloo": gloo runs ZeRO's collectives as pairwise exchanges
                            and waits for ZeRO-2/3 reduce-scatters at once (as the engine does on CPU)
``nic_gbit``                one NIC's bandwidth per direction, Gbit/s (default: the catalogue's per GPU)
``nics_per_node``           NICs per node, one rail each (default: one per GPU, rail-optimised)
``leaf_nodes``              nodes under one leaf switch of a rail (default 32)
``oversubscription``        a leaf's downlink / uplink bandwidth ratio (default 1: a non-blocking fat tree)
``node_bus_gbps``           a shared per-node bus every flow inside a node crosses (0 = none: NVSwitch);
                            models the memory bus of ranks that share one host's cores
``pcie_gbps``               host-device copies of ZeRO-Offload, GB/s per GPU (default 25: PCIe 4.0 x16)
``host_gbps``               host memory bandwidth one GPU's CPU optimizer step gets, GB/s (default 50, assumed)
``nvme_gbps``               NVMe bandwidth per GPU for ``parallel.offload = "disk"``, GB/s (default 5)
``storage_write_gbps``      aggregate checkpoint write bandwidth of the file system, GB/s (default 100)
``storage_read_gbps``       aggregate read bandwidth (default 200)
``restart_s``               seconds to reschedule and start the job after a failure, before it loads
                            its checkpoint (default 120)
==========================  ===========================================================================

An optional table ``[sim.native_collectives]`` holds the backend's own collectives as measured on the machine
(``bench/gloo_collectives.py`` fits it; ``bench/sim_validate.py`` writes it into its hardware files): per
collective ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") and group size, the line
``seconds = alpha + bytes / bandwidth`` fitted by least squares on the median call times, with every rank of
the calibration busy (groups of that size side by side), e.g. ::

    [sim.native_collectives.all-gather]
    2 = { alpha_us = 310.0, gbps = 0.12, max_error = 0.08 }

``bytes`` as :meth:`shardwise.sim.network.Fabric.time` counts them (the vector of an all-reduce, the whole
buffer of a gather, scatter or all-to-all); ``max_error`` is the fit's largest relative miss over the measured
sizes (information only). A collective the engine hands to the backend is then costed by its line instead of
by the algorithm on the links (:meth:`~shardwise.sim.network.Fabric.time` with ``native=True``); without a line
for its collective and group size -- a GPU cluster, whose NCCL runs the algorithms the links model -- it is
costed as before. Our own collectives on point-to-point messages never use it.

Fat tree and rails: Leiserson 1985, "Fat-trees: universal networks for hardware-efficient
supercomputing"; rail-optimised two-tier clusters as in NVIDIA's DGX SuperPOD reference architecture
(one NIC per GPU, GPU i of every node on leaf switches of rail i).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import tomllib

from shardwise.config import ConfigError
from shardwise.plan.hardware import GB, GPU, find_gpu, load_catalogue

HBM_GBPS = {"V100": 900.0, "A100-40GB": 1555.0, "A100-80GB": 2039.0, "H100": 3350.0, "H200": 4800.0,
            "B200": 8000.0}
"""Device memory bandwidth of the built-in GPUs, GB/s (the vendors' data sheets: V100 SXM2, A100 SXM4 40 and
80 GB, H100 SXM5, H200 SXM, HGX B200)."""

SMS = {"V100": 80, "A100-40GB": 108, "A100-80GB": 108, "H100": 132, "H200": 132, "B200": 148}
"""Streaming multiprocessors of the built-in GPUs (NVIDIA's Volta, Ampere and Hopper architecture whitepapers:
V100 SXM2 80, A100 108, H100 SXM5 132 (H200: the same GH100 die); the Blackwell datasheet's B200: 148)."""

MAMF = {"A100-40GB": 0.869, "A100-80GB": 0.869, "H100": 0.803, "H200": 0.803, "B200": 0.776}
"""Maximum achievable matmul FLOP/s over the data sheet's peak, bf16, measured by a brute-force search over shapes
(S. Bekman, "Machine Learning Engineering", compute/accelerator, "Maximum Achievable Matmul FLOPS comparison
table": A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989 ("H200 is the same"), B200 SXM 1745 of 2250): the
rate of a matrix product whose tiles fill every SM, the tile model's ``matmul_efficiency``."""

NATIVE_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
"""The backend's collectives a ``[sim.native_collectives]`` table may hold a line for."""
NATIVE_KEYS = {"alpha_us": True, "gbps": True, "max_error": False}
"""The fields of one line, and whether each is required."""

FIELDS = {
    "hbm_gbps": float, "sms": int, "matmul_efficiency": float, "attention_efficiency": float,
    "memory_efficiency": float, "kernel_overhead_us": float, "step_overhead_ms": float, "call_latency_us": float,
    "attention": str,
    "backend": str, "overlap": bool, "network_overlap": bool, "nic_gbit": float, "nics_per_node": int,
    "leaf_nodes": int, "oversubscription": float,
    "node_bus_gbps": float, "pcie_gbps": float, "host_gbps": float, "nvme_gbps": float,
    "storage_write_gbps": float, "storage_read_gbps": float, "restart_s": float, "native_collectives": dict,
}


@dataclass(frozen=True)
class NativeLine:
    """One collective of the backend on groups of ``ranks``: ``alpha + bytes * seconds_per_byte`` seconds."""

    collective: str
    ranks: int
    alpha: float
    """Seconds per call."""
    seconds_per_byte: float
    max_error: float = 0.0
    """The fit's largest relative miss over the calibration sizes (information only)."""

    def seconds(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class SimHardware:
    """Everything the simulator knows about the cluster (see the module docstring for each field)."""

    gpu: GPU
    nodes: int
    gpus_per_node: int
    hbm_bw: float
    """Bytes/s."""
    matmul_efficiency: float = 0.70
    sms: int = 0
    """Streaming multiprocessors (0: no tile model, :mod:`shardwise.sim.matmul`)."""
    attention_efficiency: float = 0.50
    memory_efficiency: float = 0.80
    kernel_overhead: float = 0.0
    """Seconds per operator."""
    step_overhead: float = 0.0
    """Seconds per optimizer step."""
    call_latency: float = 0.0
    """Seconds per collective call."""
    attention: str = "flash"
    backend: str = "nccl"
    overlap: bool = True
    network_overlap: bool = True
    nic_bw: float = 0.0
    """Bytes/s per NIC and direction (0: the catalogue's per-GPU network bandwidth)."""
    nics_per_node: int = 0
    """0: one per GPU."""
    leaf_nodes: int = 32
    oversubscription: float = 1.0
    node_bus_bw: float = 0.0
    """Bytes/s of the shared per-node bus (0: none)."""
    pcie_bw: float = 25 * GB
    host_bw: float = 50 * GB
    nvme_bw: float = 5 * GB
    storage_write_bw: float = 100 * GB
    storage_read_bw: float = 200 * GB
    restart_s: float = 120.0
    native_collectives: tuple[NativeLine, ...] = ()
    """The backend's own collectives as measured (``[sim.native_collectives]``); empty: cost them by algorithm."""

    def native_line(self, collective: str, ranks: int) -> NativeLine | None:
        """The measured line of the backend's ``collective`` on groups of ``ranks``, if the hardware has one."""
        return next((line for line in self.native_collectives
                     if line.collective == collective and line.ranks == ranks), None)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nic_bandwidth(self) -> float:
        return self.nic_bw or self.gpu.inter_bw

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node

    def peak(self, precision: str) -> float:
        return self.gpu.peak(precision)

    def replace(self, **kw) -> SimHardware:
        return dataclasses.replace(self, **kw)


def read_sim_table(path: str | Path | None) -> dict:
    """The ``[sim]`` table of a hardware file, checked field by field (an unknown or mistyped one is an error)."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"hardware file {str(p)!r} does not exist")
    try:
        table = tomllib.loads(p.read_text()).get("sim", {})
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"hardware file {str(p)!r} is not valid TOML: {e}") from None
    for key, value in table.items():
        if key not in FIELDS:
            raise ConfigError(f"hardware file {p}: sim.{key} is not a field; valid: {', '.join(sorted(FIELDS))}")
        kind = FIELDS[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"hardware file {p}: sim.{key}={value!r} must be a {kind.__name__}")
        table[key] = native_lines(value, p) if key == "native_collectives" else value
    return table


def native_lines(table: dict, path: Path | str = "--hardware") -> tuple[NativeLine, ...]:
    """The lines of a ``[sim.native_collectives]`` table, checked (one line naming the first bad entry)."""
    where = f"hardware file {path}: sim.native_collectives"
    out = []
    for collective, by_ranks in table.items():
        if collective not in NATIVE_COLLECTIVES:
            raise ConfigError(f"{where}.{collective} is not a collective; valid: {', '.join(NATIVE_COLLECTIVES)}")
        if not isinstance(by_ranks, dict):
            raise ConfigError(f"{where}.{collective} must be a table of group sizes, e.g. 2 = {{ alpha_us = 100.0, "
                              "gbps = 1.0 }")
        for ranks, line in by_ranks.items():
            name = f"{where}.{collective}.{ranks}"
            if not ranks.isdigit() or int(ranks) < 2:
                raise ConfigError(f"{name}: the key must be a group size >= 2")
            if not isinstance(line, dict) or set(line) - set(NATIVE_KEYS) or \
                    any(k not in line for k, needed in NATIVE_KEYS.items() if needed):
                raise ConfigError(f"{name}={line!r} must be {{ alpha_us = ..., gbps = ... }} (max_error optional)")
            if any(isinstance(v, bool) or not isinstance(v, int | float) for v in line.values()) or \
                    line["alpha_us"] < 0 or line["gbps"] <= 0:
                raise ConfigError(f"{name}={line!r}: alpha_us must be a number >= 0 and gbps one > 0")
            out.append(NativeLine(collective, int(ranks), line["alpha_us"] * 1e-6, 1 / (line["gbps"] * GB),
                                  float(line.get("max_error", 0.0))))
    return tuple(out)


def build_hardware(gpu_name: str, nodes: int, gpus_per_node: int, path: str | Path | None = None,
                   **overrides) -> SimHardware:
    """The cluster of ``nodes`` x ``gpus_per_node`` GPUs of type ``gpu_name`` (the catalogue, plus the
    ``[gpu.NAME]`` tables of ``path``), with the ``[sim]`` table of ``path`` and then ``overrides``
    (field names of :class:`SimHardware`'s file form) applied."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes={nodes} and --gpus-per-node={gpus_per_node} must be positive")
    try:
        gpu = find_gpu(gpu_name, load_catalogue(path))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    t = {**read_sim_table(path), **{k: v for k, v in overrides.items() if v is not None}}
    hbm = t.get("hbm_gbps", HBM_GBPS.get(gpu.name))
    if hbm is None:
        raise ConfigError(f"GPU {gpu.name!r} has no memory bandwidth in the catalogue; set sim.hbm_gbps in --hardware")
    hw = SimHardware(
        gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node, hbm_bw=hbm * GB,
        matmul_efficiency=t.get("matmul_efficiency", MAMF.get(gpu.name, 0.70)), sms=t.get("sms", SMS.get(gpu.name, 0)),
        attention_efficiency=t.get("attention_efficiency", 0.50),
        memory_efficiency=t.get("memory_efficiency", 0.80), kernel_overhead=t.get("kernel_overhead_us", 0.0) * 1e-6,
        step_overhead=t.get("step_overhead_ms", 0.0) * 1e-3, call_latency=t.get("call_latency_us", 0.0) * 1e-6,
        attention=t.get("attention", "flash"), backend=t.get("backend", "nccl"), overlap=t.get("overlap", True),
        network_overlap=t.get("network_overlap", True), nic_bw=t.get("nic_gbit", 0.0) / 8 * GB,
        nics_per_node=t.get("nics_per_node", 0),
        leaf_nodes=t.get("leaf_nodes", 32), oversubscription=t.get("oversubscription", 1.0),
        node_bus_bw=t.get("node_bus_gbps", 0.0) * GB, pcie_bw=t.get("pcie_gbps", 25.0) * GB,
        host_bw=t.get("host_gbps", 50.0) * GB, nvme_bw=t.get("nvme_gbps", 5.0) * GB,
        storage_write_bw=t.get("storage_write_gbps", 100.0) * GB,
        storage_read_bw=t.get("storage_read_gbps", 200.0) * GB, restart_s=t.get("restart_s", 120.0),
        native_collectives=t.get("native_collectives", ()))
    check(hw)
    return hw


def check(hw: SimHardware) -> None:
    """One line naming the first field out of its range."""
    for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
        if not 0 < getattr(hw, name) <= 1:
            raise ConfigError(f"sim.{name}={getattr(hw, name)} must be in (0, 1]")
    if hw.sms < 0:
        raise ConfigError(f"sim.sms={hw.sms} must be >= 0 (0: no tile model)")
    if hw.attention not in ("flash", "eager"):
        raise ConfigError(f"sim.attention={hw.attention!r} is not valid; use 'flash' or 'eager'")
    if hw.backend not in ("nccl", "gloo"):
        raise ConfigError(f"sim.backend={hw.backend!r} is not valid; use 'nccl' or 'gloo'")
    if hw.oversubscription < 1:
        raise ConfigError(f"sim.oversubscription={hw.oversubscription} must be >= 1 (downlinks / uplinks)")
    if hw.leaf_nodes < 1 or hw.nics < 1 or hw.gpus_per_node % hw.nics:
        raise ConfigError(f"sim.leaf_nodes={hw.leaf_nodes} must be >= 1 and sim.nics_per_node={hw.nics} must "
                          f"divide --gpus-per-node={hw.gpus_per_node}")
    for name in ("hbm_bw", "storage_write_bw", "storage_read_bw", "nic_bandwidth", "pcie_bw", "host_bw", "nvme_bw"):
        if getattr(hw, name) <= 0:
            raise ConfigError(f"sim: {name} must be positive")
    if min(hw.kernel_overhead, hw.step_overhead, hw.call_latency, hw.restart_s, hw.node_bus_bw) < 0:
        raise ConfigError("sim: kernel_overhead_us, step_overhead_ms, call_latency_us, restart_s and node_bus_gbps "
                          "must be >= 0")
