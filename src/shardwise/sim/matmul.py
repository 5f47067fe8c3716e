"""The time of one matrix product on a GPU from its shape: a roofline with tile and wave quantisation.

A GPU's GEMM kernel cuts the ``m x n`` output into tiles, one thread block (CTA) each, and runs them on the
streaming multiprocessors in waves (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning
Performance documentation, sections "Tile Quantization" and "Wave Quantization"):

* *tile quantisation*: a dimension that is not a multiple of the tile computes the padded tile all the same, so
  ``ceil(m / tm) * ceil(n / tn)`` tiles of ``tm x tn x k`` are computed;
* *wave quantisation*: ``sms`` tiles run at once, one per SM, so the products take ``ceil(tiles / sms)`` waves,
  the last one possibly with idle SMs;
* every tile, once its ``k`` loop is done, writes its ``tm x tn`` output to device memory (the epilogue), the
  SMs of a wave sharing the memory's bandwidth.

One tile of ``tm x tn x k`` takes ``2 tm tn k / (peak / sms * matmul_efficiency)`` -- one SM's share of the data
sheet's peak at the measured maximum achievable efficiency (:data:`shardwise.sim.hardware.MAMF`: what a product
reaches when its tiles fill every SM). The kernel picks the tile shape that finishes first among
:data:`TILES`, CUTLASS 3's Hopper GEMM tile shapes (128 x 128 and 128 x 256 in both orientations; cuBLAS
chooses among kernels of such tiles by a heuristic). A batched product (``bmm``, grouped experts) multiplies the
tiles by the batch. The product still cannot beat the memory roofline (its operands and output once through
device memory), which :class:`shardwise.sim.compute.Roofline` applies on top.

Against measured H100 products (XLA's default GEMM performance table for sm_90, bf16,
``xla/service/gpu/model/matmul_interpolator_data.h``, 29 of its shapes, 256 to 4,096 per dimension) this gives a
mean absolute error of 14 % (12 % where every dimension is at least 1,024), a single efficiency of 0.70 for
every shape 34 % (20 %). Stated plainly: the three tiles were chosen over the 128 x 256 tile in its two
orientations alone (19 %) after that comparison, so the table checks the model's form, not the tile set as a
held-out test; no constant was fitted to it. Not modelled: split-K and stream-K schedules for short, wide
products, the persistent kernels' overlap of one tile's epilogue with the next tile's loop, and clocks that
boost on short kernels.
"""

from __future__ import annotations

import math

TILES = ((128, 128), (128, 256), (256, 128))
"""Output tile shapes (rows x columns) the GEMM kernels choose from."""


def matmul_seconds(batch: int, m: int, n: int, k: int, peak: float, sms: int, efficiency: float,
                   out_bytes_per_element: float, memory_bandwidth: float) -> float:
    """Seconds of ``batch`` products of ``(m x k) @ (k x n)`` on ``sms`` SMs: the fastest tile of :data:`TILES`,
    its waves at one SM's share of ``peak * efficiency``, plus every tile's output written at
    ``memory_bandwidth`` (bytes/s)."""
    per_sm = peak * efficiency / sms
    best = math.inf
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        seconds = waves * 2.0 * tm * tn * k / per_sm + tiles * tm * tn * out_bytes_per_element / memory_bandwidth
        best = min(best, seconds)
    return best


def efficiency(batch: int, m: int, n: int, k: int, peak: float, sms: int, efficiency_max: float,
               out_bytes_per_element: float, memory_bandwidth: float) -> float:
    """The fraction of ``peak`` a product of this shape reaches under :func:`matmul_seconds`."""
    seconds = matmul_seconds(batch, m, n, k, peak, sms, efficiency_max, out_bytes_per_element, memory_bandwidth)
    return 2.0 * batch * m * n * k / (peak * seconds)


__all__ = ["TILES", "matmul_seconds", "efficiency"]
