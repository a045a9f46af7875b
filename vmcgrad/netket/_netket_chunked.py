"""NetKet's own code at vmcgrad's chunk size, for what vmcgrad does not compute itself — never unchunked.

NetKet's dispatch functions (``nk.vqs.expect``, ``expect_and_grad``, ``expect_and_forces``,
``local_estimators``) take a ``chunk_size``; where no chunked implementation is registered for a
(state, operator) pair, NetKet's fallback warns ``"Ignoring chunk_size=..."`` and runs unchunked.
:func:`call_chunked` turns that warning into an error before the unchunked program runs.

Some NetKet paths still need a chunk size that divides a sample count (the NTK on the fly of
``VMC_SR``, NetKet's ``QGTOnTheFly``): :func:`divisor_at_most` gives the largest divisor not above
the chunk size, announced once per (path, count, chunk) by :func:`warn_once`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from vmcgrad._cache import Cache
from vmcgrad._warnings import VmcgradWarning

_FALLBACK = "Ignoring chunk_size"
#: The keys already warned about (a bounded record: a key evicted long ago may warn again).
_warned = Cache(maxsize=256, name="vmcgrad.netket: warnings given once")


class NetKetChunkFallbackError(NotImplementedError):
    """NetKet has no chunked implementation for this call and would have run it unchunked."""


def call_chunked(name: str, fun: Callable, vstate: Any, operator: Any, chunk_size: Any, **kwargs: Any) -> Any:
    """``fun(vstate, operator, chunk_size, **kwargs)`` (a NetKet dispatch function), refusing its
    unchunked fallback."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=rf"\s*{_FALLBACK}")
        try:
            return fun(vstate, operator, chunk_size, **kwargs)
        except UserWarning as warning:
            if _FALLBACK not in str(warning):
                raise
            raise NetKetChunkFallbackError(
                f"{name}: NetKet has no chunked implementation for ({type(vstate).__name__}, "
                f"{type(operator).__name__}) and would run it unchunked (its warning: "
                f"{' '.join(str(warning).split())[:160]}...). vmcgrad.netket never falls back to an "
                "unchunked pass. Fix: construct the state with chunk_size=None to run it unchunked on "
                "purpose, or use an operator type NetKet chunks (numba, jax, continuous operators)."
            ) from None


def divisor_at_most(n: int, chunk_size: int) -> int:
    """The largest divisor of ``n`` that is at most ``chunk_size``."""
    for d in range(min(n, chunk_size), 0, -1):
        if n % d == 0:
            return d
    return 1


def warn_once(key: Any, message: str, *, stacklevel: int = 2) -> None:
    """A :class:`vmcgrad.VmcgradWarning`, once per ``key`` (hashable values) in this process: the one
    once-only notice of :mod:`vmcgrad.netket`. ``stacklevel`` counts from the caller (2: the line
    that called the caller)."""
    if key not in _warned:
        _warned[key] = True
        warnings.warn(message, VmcgradWarning, stacklevel=stacklevel + 1)
