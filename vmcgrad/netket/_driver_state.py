"""The resumable state of :class:`vmcgrad.netket.VMC_SR` beyond its variational state: the dict of
:meth:`VMC_SR.state_dict` and its restore, :meth:`VMC_SR.load_state_dict`."""

from __future__ import annotations

from typing import Any

import jax
import netket as nk

NAME = "vmcgrad.netket.VMC_SR"


def state_dict(driver: Any) -> dict:
    """:meth:`vmcgrad.netket.VMC_SR.state_dict` of ``driver``."""
    from flax import serialization

    sampled = isinstance(driver.state, nk.vqs.MCState)
    return {
        "step_count": int(driver.step_count),
        "optimizer_state": serialization.to_state_dict(driver._optimizer_state),
        "n_samples": int(driver.state.n_samples) if sampled else None,
        "grow": {
            "history": [[float(e), float(s)] for e, s in driver._grow_history],
            "grown": [[int(x) for x in g] for g in driver.grown],
            "stopped": bool(driver._grow_stopped),
        },
        "old_updates": driver._old_updates if driver.use_ntk else None,
    }


def load_state_dict(driver: Any, state: dict) -> None:
    """:meth:`vmcgrad.netket.VMC_SR.load_state_dict` of ``driver``."""
    from flax import serialization

    missing = [k for k in ("step_count", "optimizer_state", "grow") if k not in state]
    if missing:
        raise ValueError(
            f"{NAME}.load_state_dict: the state lacks {', '.join(map(repr, missing))}; expected a dict "
            "from VMC_SR.state_dict()."
        )
    if state.get("n_samples") is not None and isinstance(driver.state, nk.vqs.MCState):
        driver.state.n_samples = int(state["n_samples"])
    optimizer_state = serialization.to_state_dict(driver._optimizer_state)
    optimizer_state = _placed_like(optimizer_state, state["optimizer_state"], "optimizer_state")
    driver._optimizer_state = serialization.from_state_dict(driver._optimizer_state, optimizer_state)
    driver._step_count = int(state["step_count"])
    grow = state["grow"]
    driver._grow_history = [(float(e), float(s)) for e, s in grow["history"]]
    driver.grown = [tuple(int(x) for x in g) for g in grow["grown"]]
    driver._grow_stopped = bool(grow["stopped"])
    old = state.get("old_updates")
    if driver.use_ntk:
        driver._old_updates = (
            None if old is None else _placed_like(driver.state.parameters, old, "old_updates")
        )


def _placed_like(target: Any, saved: Any, name: str) -> Any:
    """:func:`placed_like` for :meth:`VMC_SR.load_state_dict`: a misfit named as its ``name`` entry."""
    try:
        return placed_like(target, saved)
    except ValueError as error:
        raise ValueError(
            f"{NAME}.load_state_dict: its {name!r} does not fit this driver's: {error}"
        ) from None


def placed_like(target: Any, saved: Any) -> Any:
    """``saved`` (a flax state dict of host or device arrays) as a pytree shaped, typed and sharded like
    ``target`` (each array placed with ``target``'s sharding); a ValueError saying what does not fit
    (another model or optimizer). The one restore of saved arrays: this driver's state and the
    command line's checkpoints (:mod:`vmcgrad.cli._checkpoint`)."""
    import numpy as np
    from flax import serialization

    try:
        tree = serialization.from_state_dict(target, saved)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"its structure differs ({error})") from None
    flat_target, treedef = jax.tree_util.tree_flatten(target)
    out = []
    for t, s in zip(flat_target, treedef.flatten_up_to(tree)):
        if not isinstance(t, jax.Array):
            out.append(s)
            continue
        s = np.asarray(s)
        if s.shape != t.shape or s.dtype != t.dtype:
            raise ValueError(
                f"an array of {s.dtype}{list(s.shape)} where the target has {t.dtype}{list(t.shape)}"
            )
        out.append(jax.make_array_from_callback(t.shape, t.sharding, lambda index, s=s: s[index]))
    return jax.tree_util.tree_unflatten(treedef, out)
