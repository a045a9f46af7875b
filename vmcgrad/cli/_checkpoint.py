"""Checkpoints of ``vmcgrad vmc``: everything a run needs to continue, written atomically as it goes.

A checkpoint holds the run's state after a completed step: the variables (parameters and model state),
the sampler's state (its chains and RNG key), the optimiser's state, the step, the per-step records of
``log.json``, the options that define the problem and the versions that wrote it. It is written to
``DIR/checkpoint.mpack`` through a temporary file that is flushed to disk and renamed over the old one
(:func:`._output.write_bytes_atomic`), so that a process killed at any instant leaves the previous
checkpoint whole, and the folder holds one checkpoint at rest. The file starts with a magic line and the
SHA-256 of its payload, so a truncated or damaged file is recognised as such, never half-read.

Next to it ``DIR/params.mpack`` holds the variables alone as :mod:`flax.serialization` bytes, in the form
a NetKet user loads in one line into a state of the same model::

    vstate.variables = flax.serialization.from_bytes(vstate.variables, open("DIR/params.mpack", "rb").read())

On ``--resume DIR`` the checkpoint is read and checked (:func:`read`), the options of the new command line
are compared with those that wrote it (:func:`differences`: the ones that change the problem must match;
``--steps`` and the process-local options may change), and the state is put back into the freshly built
driver (:func:`restore`), after which the run continues with the same program on the same inputs: on
the same devices it reproduces the energies of the run that was never interrupted bit for bit.

The payload is a :func:`flax.serialization.msgpack_serialize` state dict; ``"driver"`` holds the
driver's own state through its public interface: :meth:`vmcgrad.netket.VMC_SR.state_dict` (steps,
optimiser, samples, the ``grow_samples`` rule, the SPRING momentum), or for NetKet's drivers the step
count and optimiser state of their flax serialization.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from . import _output

#: The first bytes of every checkpoint file.
MAGIC = b"vmcgrad checkpoint\n"
#: The layout of the payload; a file of another format is refused.
FORMAT = 2
CHECKPOINT = "checkpoint.mpack"
PARAMS = "params.mpack"
#: The options that may differ between a run and its resumption (each resumed run has its own: they are
#: not taken from the checkpoint); every other option defines the problem.
MAY_CHANGE = frozenset(
    {
        "steps",
        "out",
        "resume",
        "checkpoint_every",
        "minutes",
        "distributed",
        "coordinator",
        "process_id",
        "distributed_timeout",
        "verbose",
    }
)


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, damaged, of another version or of another problem."""


def to_host(tree):
    """Every array leaf of ``tree`` as a NumPy array holding its global value (collective: every process
    of a multi-process run must call it; a leaf sharded over processes is gathered)."""
    import jax
    import numpy as np

    def leaf(x):
        if isinstance(x, jax.Array):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            if not x.is_fully_addressable:
                if x.sharding.is_fully_replicated:
                    return np.asarray(x.addressable_data(0))
                from jax.experimental import multihost_utils

                return np.asarray(multihost_utils.process_allgather(x, tiled=True))
            return np.asarray(x)
        return x

    return jax.tree_util.tree_map(leaf, tree)


def snapshot(driver, *, step: int, records: list, config: dict, info: dict) -> dict:
    """The state of ``driver`` after ``step`` completed steps, as a state dict of host arrays.

    Collective: every process calls it (sharded chains are gathered); only process 0 writes it.
    """
    from flax import serialization

    state = driver.state
    return {
        "format": FORMAT,
        "versions": info["versions"],
        "step": int(step),
        "config": json.dumps(config, sort_keys=True),
        "info": json.dumps(info, sort_keys=True),
        "records": json.dumps(records),
        "variables": to_host(serialization.to_state_dict(state.variables)),
        "sampler_state": to_host(serialization.to_state_dict(state.sampler_state)),
        "driver": to_host(driver_state(driver)),
    }


#: The entries of a NetKet driver's flax state dict (:func:`flax.serialization.to_state_dict`, which
#: NetKet registers for its drivers) that a run continues from: the steps done and the optimiser's state.
NETKET_DRIVER_ENTRIES = ("_step_count", "_optimizer_state")


def driver_state(driver) -> dict:
    """The driver's own resumable state, beyond the variational state: :meth:`vmcgrad.netket.VMC_SR.
    state_dict` (steps, optimiser, samples, the ``grow_samples`` rule, the SPRING momentum), or for
    NetKet's drivers the step count and optimiser state of their flax serialization."""
    if hasattr(driver, "load_state_dict"):  # vmcgrad.netket.VMC_SR: its public state
        return driver.state_dict()
    from flax import serialization

    saved = serialization.to_state_dict(driver)
    return {key: saved[key] for key in NETKET_DRIVER_ENTRIES}


def params_bytes(snap: dict) -> bytes:
    """``flax.serialization.to_bytes(vstate.variables)`` of the snapshot's variables."""
    from flax import serialization

    return serialization.msgpack_serialize(snap["variables"])


def encode(snap: dict) -> bytes:
    """The bytes of a checkpoint file: magic, SHA-256 of the payload (hex, one line), payload."""
    from flax import serialization

    payload = serialization.msgpack_serialize(snap)
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def write(out: Path, snap: dict) -> None:
    """Writes ``out/checkpoint.mpack``, then ``out/params.mpack``, each atomically and durably.

    Raises:
        _output.OutputError: when a file cannot be written; the previous one is then unchanged.
    """
    _output.write_bytes_atomic(out / CHECKPOINT, encode(snap))
    _output.write_bytes_atomic(out / PARAMS, params_bytes(snap))


def read(path: Path, *, version: str | None = None) -> dict:
    """The checkpoint in ``path`` (a file, or a run's folder), checked.

    Raises:
        CheckpointError: naming the file and what is wrong: missing, not a checkpoint, truncated or
            damaged (the checksum), of another format, or written by another vmcgrad ``version``.
    """
    from flax import serialization

    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: no checkpoint here (a run writes one every --checkpoint-every steps and at its end)"
        ) from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path}: not a vmcgrad checkpoint (it does not start with {MAGIC!r})")
    digest, sep, payload = data[len(MAGIC) :].partition(b"\n")
    if not sep or len(digest) != 64:
        raise CheckpointError(f"{path}: damaged or truncated (its checksum line is incomplete)")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(
            f"{path}: damaged or truncated ({len(payload)} bytes of payload do not match their SHA-256)"
        )
    try:
        snap = serialization.msgpack_restore(payload)
    except Exception as error:  # a payload that matches its checksum but is not msgpack: not ours
        raise CheckpointError(f"{path}: damaged (its payload is not msgpack: {error})") from None
    if not isinstance(snap, dict) or snap.get("format") != FORMAT:
        got = snap.get("format") if isinstance(snap, dict) else None
        raise CheckpointError(f"{path}: checkpoint format {got!r}; this vmcgrad reads format {FORMAT}")
    written_by = snap["versions"].get("vmcgrad")
    if version is not None and written_by != version:
        raise CheckpointError(
            f"{path}: written by vmcgrad {written_by}; this is vmcgrad {version}, whose programs may give "
            f"other numbers: resume with vmcgrad {written_by} (pip install vmcgrad=={written_by})"
        )
    snap["config"] = json.loads(snap["config"])
    snap["info"] = json.loads(snap["info"])
    snap["records"] = [tuple(r) for r in json.loads(snap["records"])]
    return snap


def differences(saved: dict, given: dict) -> list[str]:
    """The options in ``given`` (those on the new command line) that differ from ``saved`` and define the
    problem, as ``"--name: saved X, given Y"``."""
    out = []
    for key, value in sorted(given.items()):
        if key in MAY_CHANGE or key not in saved or saved[key] == value:
            continue
        out.append(f"--{key.replace('_', '-')}: {saved[key]!r} in the checkpoint, {value!r} given")
    return out


def restore(driver, snap: dict, path: Path):
    """Puts the checkpoint's variables, sampler state and driver state (steps, optimiser, ...) into
    ``driver``; returns the driver to run: ``driver`` itself, or for NetKet's drivers the one flax's
    :func:`~flax.serialization.from_state_dict` returns (its variational state a copy of ``driver``'s).

    Raises:
        CheckpointError: when the checkpoint's variables or states do not fit this run's (another model).
    """
    import jax
    from flax import serialization

    state = driver.state
    saved = snap.get("driver") or {}
    if hasattr(driver, "load_state_dict"):  # first: it may set n_samples, which resets the samples
        try:
            driver.load_state_dict(saved)
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}") from None
    variables = _fitted(state.variables, snap["variables"], "variables", path)
    try:
        sampler_state = serialization.from_state_dict(state.sampler_state, snap["sampler_state"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{path}: its sampler state does not fit this run's sampler ({error})"
        ) from None
    state.variables = variables
    state.sampler_state = sampler_state
    state.reset()
    if not hasattr(driver, "load_state_dict"):  # NetKet's driver: through its flax serialization
        current = serialization.to_state_dict(driver)
        try:
            entries = {key: saved[key] for key in NETKET_DRIVER_ENTRIES}
        except KeyError as error:
            raise CheckpointError(f"{path}: its driver state lacks {error}") from None
        entries["_optimizer_state"] = _fitted(
            current["_optimizer_state"], entries["_optimizer_state"], "optimizer state", path
        )
        driver = serialization.from_state_dict(driver, {**current, **entries})
    jax.block_until_ready((driver.state.variables, driver.state.sampler_state))
    return driver


def _fitted(target, saved: Any, what: str, path: Path):
    """``saved`` (a state dict of host arrays) as a pytree shaped, typed and sharded like ``target``
    (:func:`vmcgrad.netket._driver_state.placed_like`); a CheckpointError naming the file otherwise."""
    # deferred: `vmcgrad vmc --help` imports no JAX or NetKet (tests/test_package.py)
    from vmcgrad.netket._driver_state import placed_like

    try:
        return placed_like(target, saved)
    except ValueError as error:
        raise CheckpointError(f"{path}: its {what} do not fit this run's model ({error})") from None
