"""After an out-of-memory error at run time: the run retried once at half the chunk.

``chunk_size="auto"`` chooses from compiled programs (:mod:`vmcgrad._chunks.budget`), so an
out-of-memory error at run time means the budget was above what the device had free: the run is
retried once at half the chunk, with a warning, and the caller records the smaller chunk
(:func:`vmcgrad._chunks.budget.remember`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax

from vmcgrad._warnings import ChunkRetryWarning


def run_with_oom_retry(run: Callable[[int], Any], chunk: int, on_retry: Callable[[int], None], where: str):
    """Runs ``run(chunk)``; on a RESOURCE_EXHAUSTED error, warns, halves the chunk and retries once."""
    try:
        return jax.block_until_ready(run(chunk))
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err) or chunk == 1:
            raise
        smaller = max(1, chunk // 2)
        warnings.warn(
            f"{where}: out of memory at chunk_size={chunk} chosen by chunk_size='auto'; retrying once "
            f"with chunk_size={smaller}. To avoid this, pass {where} a smaller memory_budget (bytes per "
            "device) or a fixed chunk_size.",
            ChunkRetryWarning,
            stacklevel=3,
        )
        on_retry(smaller)
        return jax.block_until_ready(run(smaller))
