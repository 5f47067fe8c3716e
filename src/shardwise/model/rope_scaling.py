"""Rotary frequencies with context-extension scaling, as plain Python (no torch), so the config checks can
validate ``model.rope_scaling`` before any worker starts and the planner can read it.

``model.rope_scaling`` is ``""`` (none) or ``"KIND:key=value,key=value"``, the keys of a ``transformers``
``rope_parameters`` block. Each kind turns the RoFormer frequencies ``theta^(-2i/d)`` (Su et al. 2021, §3.4)
into scaled ones and may scale the rotation's cos/sin by an attention factor:

* ``linear`` -- position interpolation (Chen et al. 2023, "Extending Context Window of Large Language Models
  via Positional Interpolation", eq. 3): every frequency divided by ``factor``;
* ``llama3`` -- Llama 3.1's frequency-dependent interpolation (Grattafiori et al. 2024, "The Llama 3 Herd of
  Models", §3.4 and the released ``apply_scaling``): wavelengths shorter than ``original / high_freq_factor``
  kept, longer than ``original / low_freq_factor`` divided by ``factor``, the band between interpolated by
  ``s = (original / wavelength - low) / (high - low)``;
* ``yarn`` -- YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
  §3.2-3.4): per dimension a ramp between interpolation (``/ factor``) and extrapolation over the dimensions
  whose number of rotations in ``original_max_position_embeddings`` lies between ``beta_slow`` and
  ``beta_fast``, and the attention factor ``0.1 ln(factor) + 1`` (with ``mscale`` / ``mscale_all_dim``, the
  ratio of two such factors: DeepSeek-V2 §2.1.3 / V3's configuration).

Dynamic NTK scaling and LongRoPE change the frequencies with the length of each input at run time; they are
refused (:func:`parse_rope_scaling`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ROPE_KINDS = ("linear", "llama3", "yarn")
_KEYS = {
    "linear": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True, "beta_fast": False, "beta_slow": False,
             "mscale": False, "mscale_all_dim": False, "attention_factor": False, "truncate": False},
}
"""Per kind: its keys, True for a required one."""


class RopeScalingError(ValueError):
    """``model.rope_scaling`` that cannot be read (one line)."""


@dataclass(frozen=True)
class RopeScaling:
    """A parsed ``model.rope_scaling``: the kind (``""`` = none) and its parameters."""

    kind: str = ""
    params: dict = field(default_factory=dict)

    def get(self, key: str, default=None):
        return self.params.get(key, default)

    def text(self) -> str:
        """The ``model.rope_scaling`` text of this scaling (parameters in a stable order)."""
        if not self.kind:
            return ""
        return self.kind + ":" + ",".join(f"{k}={_shown(v)}" for k, v in sorted(self.params.items()))


def _shown(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return repr(v) if isinstance(v, float) else str(v)


def _number(kind: str, key: str, text: str):
    if key == "truncate":
        if text.lower() not in ("true", "false"):
            raise RopeScalingError(f"{kind}:{key}={text!r} is not true or false")
        return text.lower() == "true"
    try:
        value = float(text)
    except ValueError:
        raise RopeScalingError(f"{kind}:{key}={text!r} is not a number") from None
    if not math.isfinite(value):
        raise RopeScalingError(f"{kind}:{key}={text!r} is not a finite number")
    return int(value) if key == "original_max_position_embeddings" else value


def parse_rope_scaling(text: str) -> RopeScaling:
    """``"KIND:key=value,..."`` -> :class:`RopeScaling`; RopeScalingError (one line) for anything else."""
    text = (text or "").strip()
    if not text:
        return RopeScaling()
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in _KEYS:
        raise RopeScalingError(f"kind {kind!r} is not one we build; use one of {', '.join(map(repr, ROPE_KINDS))} "
                               "(dynamic and longrope depend on each input's length)")
    params: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS[kind]:
            raise RopeScalingError(f"{kind}: {item!r} is not a key=value of {', '.join(_KEYS[kind])}")
        params[key] = _number(kind, key, value.strip())
    missing = [k for k, required in _KEYS[kind].items() if required and k not in params]
    if missing:
        raise RopeScalingError(f"{kind} needs {', '.join(missing)}")
    if params["factor"] <= 0:
        raise RopeScalingError(f"{kind}:factor={params['factor']} must be positive")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise RopeScalingError("llama3: high_freq_factor must exceed low_freq_factor")
    return RopeScaling(kind, params)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 mscale ln(factor) + 1`` (Peng et al. 2023, eq. 22); 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling) -> tuple[list[float], float]:
    """The ``dim / 2`` rotary frequencies of a rotated width ``dim`` under ``scaling``, and the factor the
    rotation's cos and sin are multiplied by (1 unless YaRN says otherwise)."""
    base = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    p, kind = scaling.params, scaling.kind
    if kind == "":
        return base, 1.0
    factor = p["factor"]
    if kind == "linear":
        return [f / factor for f in base], 1.0
    if kind == "llama3":
        original, low, high = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
        out = []
        for f in base:
            wavelength = 2 * math.pi / f
            if wavelength < original / high:
                out.append(f)
            elif wavelength > original / low:
                out.append(f / factor)
            else:
                s = (original / wavelength - low) / (high - low)
                out.append((1 - s) * f / factor + s * f)
        return out, 1.0
    # yarn
    original = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(base):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate (keep), 1: interpolate
        out.append(f / factor * ramp + f * (1 - ramp))
    attention = p.get("attention_factor")
    if attention is None:
        mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim else _mscale(factor)
    return out, float(attention)


def softmax_scale_factor(scaling: RopeScaling) -> float:
    """DeepSeek's extra softmax scale under YaRN (DeepSeek-V2 §2.1.3's ``mscale``): ``_mscale(factor,
    mscale_all_dim)^2`` when the scaling names ``mscale_all_dim``, else 1. Multi-head latent attention multiplies
    its ``1/sqrt(d)`` by it."""
    all_dim = scaling.get("mscale_all_dim")
    if scaling.kind == "" or not all_dim:
        return 1.0
    return _mscale(scaling.params["factor"], all_dim) ** 2
