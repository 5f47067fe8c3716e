"""When a server applies pushes and when it answers a pull: BSP, SSP and ASP.

Clocks: a worker's clock c is the number of pushes it has completed; it computes clock c's gradient on
parameters pulled *at* clock c. A server's ``applied`` is the number of clocks every one of whose pushes
is in its parameters (``applied >= c``: the updates of clocks 0..c-1 are all there). The staleness of a
pull at clock c is ``c - applied``: how many clocks of updates it may lack.

* **bsp** (bulk synchronous, Valiant 1990): the pushes of one clock are averaged and applied as one
  optimizer step once every worker pushed it; a pull at clock c is answered when ``applied >= c``
  (staleness 0): synchronous data parallelism.
* **ssp** with bound s (stale synchronous parallel, Ho et al. NIPS 2013, §2-3): applied as bsp; a pull at
  clock c is answered once ``applied >= c - s`` -- it holds every update of clocks <= c - s - 1 (the read
  guarantee of Ho et al. §3) and may hold newer ones (every clock complete by the time it is answered).
  s = 0 is bsp. Adam's moments do not add, so the per-worker additive updates of Ho et al. become one
  AdamW step per complete clock; the visibility bound is theirs.
* **asp** (asynchronous, Recht et al. 2011 "Hogwild!"; Dean et al. 2012 "Downpour SGD"): every worker's
  push is one optimizer step on arrival, pulls are answered at once; ``applied`` is the smallest number
  of pushes any worker has had applied, so staleness is unbounded.
"""

from __future__ import annotations

MODES = ("bsp", "asp", "ssp")


def aggregates(mode: str) -> bool:
    """True when one clock's pushes of every worker become one update (bsp, ssp); False: one per push (asp)."""
    return mode != "asp"


def pull_ready(mode: str, clock: int, applied: int, staleness: int = 0, final: bool = False) -> bool:
    """May a pull at ``clock`` be answered now that ``applied`` clocks are complete? ``final``: the last
    pull of a run (for the final weights) waits for every clock whatever the mode."""
    if final or mode == "bsp":
        return applied >= clock
    if mode == "ssp":
        return applied >= clock - staleness
    return True


def staleness_of(clock: int, applied: int) -> int:
    """Clocks of updates a pull at ``clock`` answered with ``applied`` complete clocks may lack."""
    return max(0, clock - applied)
