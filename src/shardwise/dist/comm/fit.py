"""Fitting the cost model's lines to measured times: the calibration sizes, least squares on relative
error, and the two-regime fit of a network link (Hockney 1994)."""

from __future__ import annotations


def calibration_sizes(small: int, large: int) -> list[int]:
    """The message sizes calibration measures: ``small``, then powers of 4 from 64 KiB up to ``large``."""
    sizes, b = [small], 64 << 10
    while b < large:
        if b > small:
            sizes.append(b)
        b *= 4
    return sizes + [large] if large > small else sizes


def fit_line(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b x`` by least squares on *relative* residuals ((a + b x - t) / t),
    so that microsecond latencies and 100-ms transfers weigh alike; both kept >= 0."""
    w = [1.0 / max(t, 1e-12) for t in ts]
    # normal equations of min sum (a w + b x w - 1)^2
    s11 = sum(wi * wi for wi in w)
    s12 = sum(wi * wi * x for wi, x in zip(w, xs, strict=True))
    s22 = sum((wi * x) ** 2 for wi, x in zip(w, xs, strict=True))
    r1 = sum(w)
    r2 = sum(wi * x for wi, x in zip(w, xs, strict=True))
    det = s11 * s22 - s12 * s12
    a, b = ((r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (0.0, 0.0)
    if b < 0 or det <= 0:  # flat: a constant (the mean in the relative sense)
        return r1 / s11, 0.0
    if a < 0:  # through the origin
        return 0.0, r2 / s22
    return a, b


def fit_regimes(xs: list[float], ts: list[float], split: float = 64 << 10) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b x`` read from the two regimes, as Hockney 1994 (§3) reads a link's
    start-up time and asymptotic bandwidth: ``a`` from the sizes below ``split`` (the relative line
    through them, :func:`fit_line`), then ``b`` by ordinary least squares over the sizes from ``split``
    up, ``a`` held (so the largest transfers, where the asymptote shows, weigh most). For links that are
    not one line over all sizes: a network's small messages ride on token-bucket bursts, interrupt
    coalescing or an eager protocol, which a single relative line through all sizes turns into too
    small a per-byte time at the sizes where the bandwidth matters."""
    small = [(x, t) for x, t in zip(xs, ts, strict=True) if x < split]
    large = [(x, t) for x, t in zip(xs, ts, strict=True) if x >= split]
    if not small or not large:
        return fit_line(xs, ts)
    a = fit_line([x for x, _ in small], [t for _, t in small])[0] if len(small) > 1 else small[0][1]
    num = sum(x * (t - a) for x, t in large)
    den = sum(x * x for x, _ in large)
    return a, max(num / den, 0.0)


def relative_errors(predicted: list[float], measured: list[float]) -> list[float]:
    """``predicted / measured - 1`` per point (what ``shardwise bench comm`` reports as the prediction error)."""
    return [p / max(m, 1e-12) - 1 for p, m in zip(predicted, measured, strict=True)]
