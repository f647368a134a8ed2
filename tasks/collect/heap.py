"""The cyclic garbage collector's settings while collecting: it was about 2 CPU-s of a 20,000-rollout run.

Two costs showed in profiles of `rollflow collect`. Imports (Prefect, pydantic, aiohttp, fsspec) leave a
few hundred thousand long-lived objects that every full collection rescans. And with the default young
threshold (700 allocations) a collection runs every few rollouts, while hundreds of requests are in
flight: their objects survive it, are promoted and walked again by the older generations, although
nearly all of them are freed by reference counting. Freezing the start-up objects once and letting the
young generation grow to YOUNG_THRESHOLD removes most of that work; cycles are still collected.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000

_state = {"done": False}


def tune_gc_for_collection() -> bool:
    """Freeze every object alive now and raise the young threshold, once per process.

    Later calls do nothing, so the run's own garbage is never frozen: memory stays bounded however many
    chunks a process runs. A larger threshold set by the user is kept. Returns whether this call acted.
    """
    if _state["done"]:
        return False
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    _state["done"] = True
    return True
