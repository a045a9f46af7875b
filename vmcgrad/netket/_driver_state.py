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
    """``saved`` (a state dict of host or device arrays) as a pytree shaped, typed and sharded like
    ``target``; a ValueError naming ``name`` when it does not fit."""
    import numpy as np
    from flax import serialization

    where = f"{NAME}.load_state_dict: its {name!r}"
    try:
        tree = serialization.from_state_dict(target, saved)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{where} does not fit this driver's ({error})") from None
    flat_target, treedef = jax.tree_util.tree_flatten(target)
    out = []
    for t, s in zip(flat_target, treedef.flatten_up_to(tree)):
        if not isinstance(t, jax.Array):
            out.append(s)
            continue
        s = np.asarray(s)
        if s.shape != t.shape or s.dtype != t.dtype:
            raise ValueError(
                f"{where} does not fit this driver's: an array of {s.dtype}{list(s.shape)} where this "
                f"driver has {t.dtype}{list(t.shape)} (another model or optimizer)"
            )
        out.append(jax.make_array_from_callback(t.shape, t.sharding, lambda index, s=s: s[index]))
    return jax.tree_util.tree_unflatten(treedef, out)
