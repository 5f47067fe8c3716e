"""Hardware catalogue: accelerators (peak FLOP/s per dtype, memory, links) and clusters.

Peak FLOP/s are dense tensor-core numbers (no 2:4 sparsity) from the vendors' data sheets:
  * V100: NVIDIA Tesla V100 data sheet (SXM2, 2020): 125 TFLOP/s fp16, 15.7 fp32, 32 GB, NVLink 300 GB/s.
  * A100: NVIDIA A100 data sheet (SXM4, 2021): 312 TFLOP/s bf16/fp16, 19.5 fp32, 40/80 GB, NVLink 600 GB/s.
  * H100: NVIDIA H100 data sheet (SXM5, 2023): 989 TFLOP/s bf16/fp16, 1979 fp8, 67 fp32, 80 GB, NVLink 900 GB/s.
  * H200: NVIDIA H200 data sheet (SXM, 2024): H100's compute, 141 GB, NVLink 900 GB/s.
  * B200: NVIDIA HGX B200 data sheet (2024): 2250 TFLOP/s bf16/fp16, 4500 fp8, 80 fp32, 180 GB, NVLink 1800 GB/s.

NVLink figures in data sheets are bidirectional totals; ``intra_bw`` here is the one-direction
bandwidth per GPU (half of it), the quantity the alpha-beta model of collectives uses.
``inter_bw`` is the one-direction network bandwidth per GPU (one NIC per GPU: 100 Gb/s EDR for
V100 systems, 200 Gb/s HDR for DGX A100, 400 Gb/s NDR for DGX H100/H200/B200).

The catalogue is extensible: :func:`load_catalogue` reads a TOML file of ``[gpu.NAME]`` tables
(see ``configs/hardware.toml``) and adds or replaces entries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import tomllib

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class GPU:
    """One accelerator type."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype ("bf16", "fp16", "fp32", "fp8"); 0 or absent = unsupported."""
    memory_bytes: float
    """Device memory."""
    intra_bw: float
    """Intra-node (NVLink) bandwidth per GPU, one direction, bytes/s."""
    inter_bw: float
    """Inter-node (network) bandwidth per GPU, one direction, bytes/s."""
    intra_latency: float = 5e-6
    """Intra-node latency alpha of one message, seconds."""
    inter_latency: float = 10e-6
    """Inter-node latency alpha of one message, seconds."""
    node_bw: float = 0.0
    """The node's whole link to the other nodes, one direction, bytes/s, shared by its GPUs' flows (the
    max-rate model of Gropp, Olson & Samfass 2016, §3: k flows at once get ``min(inter_bw, node_bw / k)``
    each); 0: one NIC per GPU, ``gpus_per_node * inter_bw``."""

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for training in ``precision`` (falls back to fp32 when the dtype is unsupported)."""
        value = self.peak_flops.get(precision, 0.0)
        return value if value > 0 else self.peak_flops.get("fp32", 0.0)


def _gpu(name, bf16, fp16, fp32, mem_gb, nvlink_bidir_gbs, nic_gbit, fp8=0.0) -> GPU:
    return GPU(
        name=name,
        peak_flops={"bf16": bf16 * TFLOPS, "fp16": fp16 * TFLOPS, "fp32": fp32 * TFLOPS, "fp8": fp8 * TFLOPS},
        memory_bytes=mem_gb * GB,
        intra_bw=nvlink_bidir_gbs / 2 * GB,
        inter_bw=nic_gbit / 8 * GB,
    )


BUILTIN_GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        _gpu("V100", 0.0, 125, 15.7, 32, 300, 100),
        _gpu("A100-40GB", 312, 312, 19.5, 40, 600, 200),
        _gpu("A100-80GB", 312, 312, 19.5, 80, 600, 200),
        _gpu("H100", 989, 989, 67, 80, 900, 400, fp8=1979),
        _gpu("H200", 989, 989, 67, 141, 900, 400, fp8=1979),
        _gpu("B200", 2250, 2250, 80, 180, 1800, 400, fp8=4500),
    )
}
ALIASES = {"A100": "A100-80GB", "V100-32GB": "V100", "H100-80GB": "H100"}

GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": BUILTIN_GPUS["H200"].peak_flops,
    "H100": BUILTIN_GPUS["H100"].peak_flops,
    "A100": BUILTIN_GPUS["A100-80GB"].peak_flops,
    "V100": BUILTIN_GPUS["V100"].peak_flops,
    "B200": BUILTIN_GPUS["B200"].peak_flops,
}
"""Peak FLOP/s by GPU family, matched as a substring of ``torch.cuda.get_device_name``."""


def peak_flops_for_device_name(device_name: str, precision: str) -> float:
    """Peak FLOP/s of a CUDA device from its name (e.g. "NVIDIA A100-SXM4-80GB"); 0 if unknown."""
    for family, table in GPU_PEAK_FLOPS.items():
        if family in device_name:
            value = table.get(precision, 0.0)
            return value if value > 0 else table["fp32"]
    return 0.0


def load_catalogue(path: str | Path | None = None) -> dict[str, GPU]:
    """The built-in GPUs, plus/overridden by the ``[gpu.NAME]`` tables of a TOML file.

    Fields of a table: ``bf16_tflops``, ``fp16_tflops``, ``fp32_tflops``, ``fp8_tflops``,
    ``memory_gb``, ``nvlink_gbps`` (bidirectional GB/s), ``network_gbit`` (Gb/s per GPU),
    ``intra_latency_us``, ``inter_latency_us``, ``node_network_gbit`` (Gb/s of the node's link, shared
    by its GPUs; default one NIC per GPU); a table naming a built-in GPU changes only the fields it gives.
    """
    catalogue = dict(BUILTIN_GPUS)
    if path is None:
        return catalogue
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"hardware file {str(p)!r} does not exist")
    try:
        tree = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"hardware file {str(p)!r} is not valid TOML: {e}") from None
    known = {"bf16_tflops", "fp16_tflops", "fp32_tflops", "fp8_tflops", "memory_gb", "nvlink_gbps",
             "network_gbit", "intra_latency_us", "inter_latency_us", "node_network_gbit"}
    for name, t in tree.get("gpu", {}).items():
        unknown = set(t) - known
        if unknown:
            raise ValueError(f"hardware file {p}: gpu.{name} has unknown fields {sorted(unknown)}; "
                             f"valid: {sorted(known)}")
        base = catalogue.get(ALIASES.get(name, name))
        peaks = dict(base.peak_flops) if base else {}
        for dtype in ("bf16", "fp16", "fp32", "fp8"):
            if f"{dtype}_tflops" in t:
                peaks[dtype] = float(t[f"{dtype}_tflops"]) * TFLOPS
        fields = dict(
            name=name, peak_flops=peaks,
            memory_bytes=float(t["memory_gb"]) * GB if "memory_gb" in t else (base.memory_bytes if base else 0.0),
            intra_bw=float(t["nvlink_gbps"]) / 2 * GB if "nvlink_gbps" in t else (base.intra_bw if base else 0.0),
            inter_bw=float(t["network_gbit"]) / 8 * GB if "network_gbit" in t else (base.inter_bw if base else 0.0),
        )
        if "intra_latency_us" in t:
            fields["intra_latency"] = float(t["intra_latency_us"]) * 1e-6
        elif base:
            fields["intra_latency"] = base.intra_latency
        if "inter_latency_us" in t:
            fields["inter_latency"] = float(t["inter_latency_us"]) * 1e-6
        elif base:
            fields["inter_latency"] = base.inter_latency
        if "node_network_gbit" in t:
            fields["node_bw"] = float(t["node_network_gbit"]) / 8 * GB
        elif base:
            fields["node_bw"] = base.node_bw
        gpu = GPU(**fields)
        if gpu.memory_bytes <= 0 or gpu.intra_bw <= 0 or gpu.inter_bw <= 0 or gpu.peak("fp32") <= 0:
            raise ValueError(f"hardware file {p}: gpu.{name} needs fp32_tflops, memory_gb, nvlink_gbps and "
                             "network_gbit > 0")
        catalogue[name] = gpu
    return catalogue


def find_gpu(name: str, catalogue: dict[str, GPU] | None = None) -> GPU:
    """Look a GPU up by name (case-insensitive, with aliases such as "A100" for "A100-80GB")."""
    catalogue = catalogue or BUILTIN_GPUS
    by_lower = {k.lower(): v for k, v in catalogue.items()}
    aliases = {k.lower(): v for k, v in ALIASES.items()}
    key = aliases.get(name.lower(), name).lower()
    if key in by_lower:
        return by_lower[key]
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    raise ValueError(f"unknown GPU {name!r}; use one of {', '.join(catalogue)} (or add it with --hardware FILE.toml)")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` identical GPUs: a two-level network."""

    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    efficiency: float = 0.5
    """Fraction of peak FLOP/s that the matmuls of training reach (the model's compute efficiency)."""
    overlap: float = 1.0
    """Fraction of the backward pass that data-parallel / ZeRO communication can hide behind."""
    call_latency: float = 0.0
    """Seconds every collective call costs beyond its messages when the ranks compute between calls:
    a rank that arrives first waits for the last (on CPU ranks sharing cores, also for a core). Not
    hidden. 0 (the default) for accelerators, whose collectives are queued behind the kernels; measured
    for a CPU cluster by ``bench/bench_multinode.py`` (a small all-reduce between compute bursts)."""
    backend: str = "nccl"
    """The process-group backend the trainer runs: with "gloo" (CPU) ZeRO's reduce-scatters and
    all-gathers are pairwise exchanges posted at once (shardwise.parallel.zero.exchange), not rings."""

    @property
    def node_bw(self) -> float:
        """One node's link to the others, bytes/s (one direction)."""
        return self.gpu.node_bw or self.gpus_per_node * self.gpu.inter_bw

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def replace(self, **kw) -> Cluster:
        return dataclasses.replace(self, **kw)
