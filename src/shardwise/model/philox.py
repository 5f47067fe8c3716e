"""Philox4x32-10, a counter-based random number generator, with torch integer ops.

Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3" (SC '11), §4.2: a
counter-based generator is a stateless function ``(key, counter) -> random bits``. Any element's bits
follow from its own counter, in any order, on any process -- so a process holding a slice of a tensor
draws exactly the bits one process draws for those elements, and draws nothing for the rest.

Philox4x32 holds a counter of four 32-bit words ``(c0, c1, c2, c3)`` and a key of two ``(k0, k1)``. One
round takes the two 64-bit products ``M0 * c0 = (hi0, lo0)`` and ``M1 * c2 = (hi1, lo1)`` and sets

    (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

and the key is bumped by the Weyl constants ``(W0, W1)`` between rounds. Ten rounds is the paper's
recommended Philox4x32 (Table 2: seven pass BigCrush; ten leave a safety margin); the constants are the
paper's, as in its reference implementation Random123 (whose known-answer vectors ``tests/test_dropout.py``
checks).

torch has no unsigned 32- or 64-bit multiply on every device: the words live in int64 tensors holding
values in ``[0, 2^32)``, and the int64 product of two such values keeps the bits of the unsigned 64-bit
product (two's-complement wrap-around), so its low and high halves are exact.
"""

from __future__ import annotations

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57
"""The round multipliers (Salmon et al. 2011, §4.2; Random123's PHILOX_M4x32_0 / _1)."""
W0, W1 = 0x9E3779B9, 0xBB67AE85
"""The key's Weyl increments: the golden ratio and sqrt(3) - 1, as 32-bit fractions."""
ROUNDS = 10
WORD = 0xFFFFFFFF


def philox4x32(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[int, int],
               rounds: int = ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four 32-bit output words (int64 tensors in ``[0, 2^32)``) of Philox4x32 at ``counter`` (four int64
    tensors of one shape, or broadcastable to it, each word in ``[0, 2^32)``) under ``key`` (two 32-bit ints).

    Elementwise, on six buffers of the counter's shape."""
    words = [c.clone(memory_format=torch.contiguous_format) for c in torch.broadcast_tensors(*counter)]
    return philox4x32_(words, key, rounds)


def philox4x32_(words: list[torch.Tensor], key: tuple[int, int],
                rounds: int = ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`philox4x32` overwriting ``words`` (four contiguous int64 tensors of one shape, the counter)."""
    c0, c1, c2, c3 = words
    p0, p1 = torch.empty_like(c0), torch.empty_like(c0)
    k0, k1 = key[0] & WORD, key[1] & WORD
    for _ in range(rounds):
        torch.mul(c0, M0, out=p0)
        torch.mul(c2, M1, out=p1)
        torch.bitwise_right_shift(p1, 32, out=c0)  # hi1 (its sign bits cleared below)
        c0.bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(WORD)
        torch.bitwise_and(p1, WORD, out=c1)  # lo1
        torch.bitwise_right_shift(p0, 32, out=c2)  # hi0
        c2.bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(WORD)
        torch.bitwise_and(p0, WORD, out=c3)  # lo0
        k0, k1 = (k0 + W0) & WORD, (k1 + W1) & WORD
    return c0, c1, c2, c3


def philox4x32_traced(words: list[torch.Tensor], key: tuple[int, int] | tuple[torch.Tensor, torch.Tensor],
                      rounds: int = ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`philox4x32_` written for ``torch.compile``: out of place (TorchInductor fuses the ten rounds into one
    kernel) and with the key as 0-dim int64 tensors on the counter's device. A key that changes every step is
    then an input of one compiled graph, not a constant: an int key that changes is made symbolic by TorchDynamo,
    and TorchInductor's CPU code for bitwise operators on a symbolic int does not build (torch 2.13). The same
    bits as :func:`philox4x32_`."""
    c0, c1, c2, c3 = words
    k0, k1 = (k if isinstance(k, torch.Tensor) else torch.scalar_tensor(k, dtype=torch.int64, device=c0.device)
              for k in key)
    k0, k1 = k0 & WORD, k1 & WORD
    for _ in range(rounds):
        p0, p1 = c0 * M0, c2 * M1
        c0, c1 = ((p1 >> 32) ^ c1 ^ k0) & WORD, p1 & WORD
        c2, c3 = ((p0 >> 32) ^ c3 ^ k1) & WORD, p0 & WORD
        k0, k1 = (k0 + W0) & WORD, (k1 + W1) & WORD
    return c0, c1, c2, c3
