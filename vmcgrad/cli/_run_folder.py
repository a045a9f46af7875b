"""A ``vmcgrad vmc`` run folder is a state: ``run.json`` records the problem, :func:`load_run` rebuilds it.

``DIR/run.json`` is written once, before the first step (and again, the same, by a resumed run). It
records everything needed to rebuild the run's NetKet objects without reading the source: the system
(a built-in name and ``L``, or the ``MODULE:FACTORY`` spec of the user's factory with its file's
absolute path), the model with its options (for a user's model its spec), the sampler, the driver
(the ``--driver`` given and the one taken, with why), the memory budget and the chunks taken, the
seeds, the samples, the parameters' dtype and the versions of vmcgrad, JAX, NetKet and flax.

:func:`load_run` reads it back: the NetKet state rebuilt from that record with the trained variables of
``DIR/params.mpack``, the Hamiltonian, the parsed ``log.json`` and the record itself::

    from vmcgrad.cli import load_run

    run = load_run("vmcgrad-run")
    run.state.expect(run.hamiltonian)  # the trained state's energy

Nothing here imports JAX or NetKet at import time (``vmcgrad --help`` stays fast).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from . import _systems, _user_problem

#: The record's name in the run folder, and its layout (a record of another format is refused).
RUN_FILE = "run.json"
FORMAT = 1
NAME = "vmcgrad.cli.load_run"


class RunFolderError(ValueError):
    """A folder :func:`load_run` cannot rebuild a state from; the message says what was given, what
    was expected and the fix."""


class Run(NamedTuple):
    """A finished (or stopped) ``vmcgrad vmc`` run, rebuilt by :func:`load_run`.

    Attributes:
        state: a NetKet ``MCState`` (``vmcgrad.netket.MCState``) of the run's model and sampler, with
            the trained variables of ``params.mpack``.
        hamiltonian: the run's Hamiltonian (a NetKet operator).
        log: the parsed ``log.json`` (per-step energies, final figures, ``config``, ``info``).
        config: the parsed ``run.json`` (the record of the problem).
    """

    state: Any
    hamiltonian: Any
    log: dict
    config: dict


def record(args, system, model, vstate, info: dict, driver: dict) -> dict:
    """The ``run.json`` of a run: its problem, as built (see the module docstring)."""
    import jax
    import numpy as np

    if _user_problem.is_spec(args.system):
        system_record = {"factory": args.system, "file": _factory_file(args.system)}
    else:
        system_record = {"name": args.system, "L": args.L}
    system_record.update(description=system.description, n_sites=system.n_sites)
    if _user_problem.is_spec(args.model):
        model_record = {"factory": args.model, "file": _factory_file(args.model)}
    else:
        model_record = {"name": args.model, "options": _systems.MODEL_OPTIONS[args.model]}
    model_record.update(
        type=f"{type(model).__module__}.{type(model).__qualname__}", n_parameters=int(vstate.n_parameters)
    )
    sampler = vstate.sampler
    dtypes = sorted({str(np.dtype(x.dtype)) for x in jax.tree_util.tree_leaves(vstate.parameters)})
    return {
        "format": FORMAT,
        "system": system_record,
        "model": model_record,
        "sampler": {
            "type": f"netket.sampler.{type(sampler).__name__}",
            "rule": type(getattr(sampler, "rule", None)).__name__,
            "n_chains": int(sampler.n_chains),
            "n_discard_per_chain": int(vstate.n_discard_per_chain),
        },
        "samples": int(vstate.n_samples),
        "driver": driver,
        "optimizer": {"type": "netket.optimizer.Sgd", "learning_rate": args.lr},
        "budget": {
            "memory_budget": args.memory_budget,
            "chunk_size": args.chunk_size,
            "chunks": info["chunk_size"],
            "qgt_design": info["qgt_design"],
        },
        "seeds": {"parameters": args.seed, "sampler": args.seed + 1},
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "devices": {"n_devices": info["n_devices"], "n_processes": info["n_processes"]},
        "versions": info["versions"],
        "files": {"log": "log.json", "params": "params.mpack", "checkpoint": "checkpoint.mpack"},
    }


def _factory_file(spec: str) -> str | None:
    """The absolute path of a ``FILE.py:FACTORY`` spec's file (None for a dotted module)."""
    module = spec.rpartition(":")[0]
    if module.endswith(".py") or "/" in module or "\\" in module:
        return str(Path(module).resolve())
    return None


def load_run(path: str | Path = "vmcgrad-run") -> Run:
    """The run in the folder ``path`` (a ``vmcgrad vmc --out``) as a NetKet state with its trained
    parameters, its Hamiltonian, its log and its record (:class:`Run`).

    The system, model and sampler are rebuilt from ``run.json`` (a user's ``MODULE:FACTORY`` is
    imported again: from its recorded file, else as given, relative to the current directory), the
    state with the run's samples, chains, seeds and gradient chunk, and ``params.mpack`` is loaded into
    it. Call it in a process whose devices can hold the run's chains (any number for a run on one
    device; for a sharded run, a device count that divides its chains, as NetKet requires).

    Raises:
        RunFolderError: naming the folder, what is missing or does not fit, and the fix: no such
            folder, no ``run.json`` (a run of an older vmcgrad, or not a run folder), no
            ``params.mpack`` or ``log.json``, a damaged file, or parameters of another model.
    """
    folder = Path(path)
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise RunFolderError(
            f"{NAME}({str(path)!r}): {folder} {what}; expected the folder of a `vmcgrad vmc` run "
            "(its --out, default vmcgrad-run). Fix: pass that folder's path"
        )
    config = _read_json(folder, RUN_FILE)
    if config.get("format") != FORMAT:
        raise RunFolderError(
            f"{NAME}({str(path)!r}): {folder / RUN_FILE} has format {config.get('format')!r}; this vmcgrad "
            f"reads format {FORMAT}. Fix: load it with the vmcgrad that wrote it "
            f"({config.get('versions', {}).get('vmcgrad')})"
        )
    log = _read_json(folder, "log.json")
    params = folder / "params.mpack"
    if not params.is_file():
        raise RunFolderError(
            f"{NAME}({str(path)!r}): no params.mpack in {folder}; expected the trained parameters a run "
            "writes every --checkpoint-every steps and at its end (this run stopped before its first). "
            f"Fix: continue it with `vmcgrad vmc --resume {folder}`"
        )
    system, model = _rebuild(config, folder, path)
    state = _state(config, system, model)
    _load_params(state, params, path)
    return Run(state=state, hamiltonian=system.hamiltonian, log=log, config=config)


def _read_json(folder: Path, name: str) -> dict:
    file = folder / name
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        if name == RUN_FILE:
            found = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
            holds = ", ".join(found) or "nothing"
            raise RunFolderError(
                f"{NAME}({str(folder)!r}): no {RUN_FILE} in {folder} (it holds {holds}); "
                f"expected the folder of a `vmcgrad vmc` run, whose {RUN_FILE} records the problem. "
                "Fix: pass a run's --out folder; a run of a vmcgrad older than load_run wrote none: run it "
                "again, or rebuild its model as docs/cli.md shows and load params.mpack with "
                "flax.serialization.from_bytes"
            ) from None
        raise RunFolderError(
            f"{NAME}({str(folder)!r}): no {name} in {folder}; expected the log every run writes. Fix: "
            "pass a run's --out folder, whole"
        ) from None
    except (OSError, ValueError) as error:
        raise RunFolderError(
            f"{NAME}({str(folder)!r}): {file} cannot be read as JSON ({type(error).__name__}: {error}); "
            "expected the file the run wrote. Fix: restore it from a copy of the run folder"
        ) from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{NAME}({str(folder)!r}): {file} holds a {type(data).__name__}, not a dict")
    return data


def _rebuild(config: dict, folder: Path, path) -> tuple[Any, Any]:
    """The run's System and flax module, from the record."""

    def spec_of(entry: dict) -> str:
        spec, file = entry["factory"], entry.get("file")
        return f"{file}:{spec.rpartition(':')[2]}" if file and Path(file).is_file() else spec

    try:
        entry = config["system"]
        if "factory" in entry:
            system = _user_problem.build_system(spec_of(entry))
        else:
            system = _systems.build(entry["name"], entry["L"])
        entry = config["model"]
        if "factory" in entry:
            model = _user_problem.build_model(spec_of(entry), system)
        else:
            model = _systems.make_model(entry["name"], system)
    except _user_problem.UserProblemError as error:
        inner = str(error).removeprefix("argument ").split(". Fix:")[0]
        raise RunFolderError(
            f"{NAME}({str(path)!r}): the run's own factory cannot be rebuilt ({inner}); expected its "
            "recorded file, or its module importable here. Fix: call load_run where the run was started, "
            "with the factory's file in place"
        ) from None
    except (KeyError, TypeError) as error:
        raise RunFolderError(
            f"{NAME}({str(path)!r}): {folder / RUN_FILE} lacks {error}; expected the record a run writes"
        ) from None
    return system, model


def _state(config: dict, system, model):
    """The run's MCState: its sampler, samples, chains, seeds and gradient chunk."""
    import jax

    # deferred: `import vmcgrad.cli` imports no JAX or NetKet (tests/test_package.py)
    import vmcgrad.netket as vnk

    n_chains = int(config["sampler"]["n_chains"])
    n_devices = jax.device_count()
    if n_chains % n_devices:  # NetKet shards the chains over the devices
        n_chains += n_devices - n_chains % n_devices
    chunk = config["budget"]["chunks"].get("gradient")
    return vnk.MCState(
        system.make_sampler(n_chains),
        model,
        n_samples=int(config["samples"]),
        n_discard_per_chain=int(config["sampler"]["n_discard_per_chain"]),
        chunk_size=chunk if isinstance(chunk, int) else None,
        memory_budget=config["budget"]["memory_budget"],
        seed=int(config["seeds"]["parameters"]),
        sampler_seed=int(config["seeds"]["sampler"]),
    )


def _load_params(state, params: Path, path) -> None:
    import jax
    import numpy as np
    from flax import serialization

    try:
        loaded = serialization.from_bytes(state.variables, params.read_bytes())
        pairs = zip(jax.tree_util.tree_leaves(state.variables), jax.tree_util.tree_leaves(loaded))
        for want, got in pairs:
            if np.shape(got) != want.shape or np.asarray(got).dtype != want.dtype:
                raise ValueError(
                    f"an array of {np.asarray(got).dtype}{list(np.shape(got))} where the model has "
                    f"{want.dtype}{list(want.shape)}"
                )
        state.variables = loaded
    except Exception as error:  # flax raises ValueError, KeyError or msgpack's errors
        raise RunFolderError(
            f"{NAME}({str(path)!r}): {params} does not fit the recorded model "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); expected the "
            "parameters the run wrote. Fix: restore the run folder whole (run.json and params.mpack "
            "of one run)"
        ) from None
