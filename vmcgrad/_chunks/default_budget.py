"""The default memory budget: what every entry point's ``memory_budget=None`` means.

Half the device's free memory where the backend reports it (``device.memory_stats()``: GPUs,
TPUs), read **once** per device and process, else :data:`DEFAULT_MEMORY_BUDGET` (CPUs report
nothing). Every automatic choice is cached per budget, so a budget that followed the memory in use
would change between two steps (new samples, parameters and optimiser state allocated before the
old ones are freed) and search again each step, and within one choice it could change between the
search and the lookup of its record. The first read is the one every later choice sees.
"""

from __future__ import annotations

from typing import Any

import jax

from vmcgrad._cache import Cache

#: Budget in bytes per device when the backend does not report its free memory (CPU): 2 GiB.
DEFAULT_MEMORY_BUDGET = 2 * 2**30
#: Fraction of the reported free device memory used as the default budget.
FREE_MEMORY_FRACTION = 0.5
#: The default budget of each device, as first read (a device's budget is fixed for the process).
_READ = Cache(maxsize=64, name="the default memory budget of each device, as first read")


def default_memory_budget(device: Any = None) -> int:
    """Half the free memory of ``device`` (default: the first local device) when first read in this
    process, the same on every later call; 2 GiB if the backend reports none."""
    device = device or _first_device()
    if device in _READ:
        return _READ.get(device)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        budget = int(FREE_MEMORY_FRACTION * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    else:
        budget = DEFAULT_MEMORY_BUDGET
    _READ[device] = budget
    return budget


def _first_device() -> Any:
    """The device a default budget is read from where none is given: the first local device."""
    return jax.local_devices()[0]


def budget_or_default(budget: int | float | None) -> int | float:
    """``budget`` (bytes per device, as the user gave it), or :func:`default_memory_budget` where it
    is None: every entry point's ``memory_budget=None`` means this."""
    return default_memory_budget() if budget is None else budget
