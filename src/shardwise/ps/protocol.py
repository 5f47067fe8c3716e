"""The messages between workers and servers, on torch.distributed point-to-point (gloo / NCCL isend, irecv).

Every request is a small float64 *header* ``[kind, clock, a, b]`` on tag :data:`HEADER`; a push's payload
follows on tag :data:`DATA`; a server's answers go back on tag :data:`REPLY`. Messages between one worker
and one server are matched in order per tag, so a server reads one worker's requests in the order sent.

* ``PUSH  [1, c, key, 0]`` + payload: the (compressed) gradient of partition ``key`` for clock c;
* ``END   [2, c, 0, sq]``: the worker's pushes of clock c are all sent; ``sq`` is its gradient's squared
  norm (asp clips each push by it);
* ``PULL  [3, c, final, 0]``: parameters for clock c; answered with an info row ``[applied, updates,
  pushes, staleness, norm]`` (norm: the gradient norm of the newest update applied) and then each of
  the server's partitions, in key order;
* ``CKPT  [4, step, 0, 0]``: every message before it is in; the server joins the checkpoint at ``step``;
* ``STOP  [5, c, 0, 0]``: the worker is done.

Push compression (:class:`PushCodec`) reuses :mod:`shardwise.dist.comm.compress`'s int8 quantizer and the
top-k rule, each with error feedback on the worker (Lin et al. ICLR 2018 §3; Stich et al. NeurIPS 2018):
what a push leaves out is added to that partition's next push.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch

from shardwise.dist.comm.compress import dequantize_int8, quantize_int8

HEADER, DATA, REPLY = 11, 12, 13
PUSH, END, PULL, CKPT, STOP = 1, 2, 3, 4, 5
FAILED = -1
"""Not a message: a server's listener reports a broken connection with it."""
INFO = 5
"""Length of a pull's info row."""


def header(kind: int, clock: int, a: float = 0.0, b: float = 0.0) -> torch.Tensor:
    return torch.tensor([kind, clock, a, b], dtype=torch.float64)


def wait(work, timeout_s: float, what) -> None:
    """Wait for a send / receive / collective, or raise TimeoutError naming ``what`` (a string, or a
    callable giving one when the wait failed); a broken connection is a RuntimeError naming it too."""
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        text = what() if callable(what) else what
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TimeoutError(f"{text}: no answer within {timeout_s:g} s") from None
        raise RuntimeError(f"{text}: {str(e).splitlines()[0]}") from None
    if ok is False:
        raise TimeoutError(f"{what() if callable(what) else what}: no answer within {timeout_s:g} s")


class PushCodec:
    """Encode a partition's gradient into the bytes a push sends, and decode them on the server.

    ``method``: "none" (fp32), "fp16" / "bf16" (cast), "int8" (absmax per ``chunk`` values, as
    :func:`shardwise.dist.comm.compress.quantize_int8`) or "topk" (the ``ratio`` largest-magnitude entries
    as int32 index + fp32 value pairs). int8 and top-k keep a residual per key on the worker."""

    HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, method: str = "none", ratio: float = 0.01, chunk: int = 256):
        self.method, self.ratio, self.chunk = method, ratio, chunk
        self.residual: dict[int, torch.Tensor] = {}

    def _k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(numel * self.ratio)))

    def _padded(self, numel: int) -> int:
        return math.ceil(numel / self.chunk) * self.chunk

    def payload(self, numel: int) -> torch.Tensor:
        """An empty receive buffer for a push of a ``numel``-element partition."""
        if self.method == "none":
            return torch.empty(numel, dtype=torch.float32)
        if self.method in self.HALF:
            return torch.empty(numel, dtype=self.HALF[self.method])
        if self.method == "int8":
            n = self._padded(numel)
            return torch.empty(n + 4 * (n // self.chunk), dtype=torch.uint8)
        return torch.empty(8 * self._k(numel), dtype=torch.uint8)

    @torch.no_grad()
    def encode(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        g = grad.detach().reshape(-1).float()
        if self.method == "none":
            return g.clone()
        if self.method in self.HALF:
            return g.to(self.HALF[self.method])
        numel = g.numel()
        if self.method == "int8":
            r = self.residual.setdefault(key, torch.zeros(self._padded(numel)))
            r[:numel].add_(g)
            q, scale = quantize_int8(r, self.chunk)
            r.sub_(dequantize_int8(q, scale, self.chunk))
            return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)])
        r = self.residual.setdefault(key, torch.zeros(numel))
        r.add_(g)
        idx = r.abs().topk(self._k(numel), sorted=False).indices
        vals = r[idx].clone()
        r[idx] = 0
        return torch.cat([idx.to(torch.int32).view(torch.uint8), vals.view(torch.uint8)])

    @torch.no_grad()
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if self.method == "none":
            return payload
        if self.method in self.HALF:
            return payload.float()
        if self.method == "int8":
            n = self._padded(numel)
            q, scale = payload[:n].view(torch.int8), payload[n:].view(torch.float32)
            return dequantize_int8(q, scale, self.chunk)[:numel]
        k = self._k(numel)
        out = torch.zeros(numel)
        out.index_add_(0, payload[:4 * k].view(torch.int32).long(), payload[4 * k:].view(torch.float32))
        return out
