"""The user's own problem: ``--system MODULE:FACTORY`` and ``--model MODULE:FACTORY``.

``MODULE`` is a dotted module path (``mypackage.models``, importable from here) or the path of a
Python file (``docs/examples/my_problem.py``, loaded as a module of its own; its folder is not added to
``sys.path``). ``FACTORY`` names a function in it, called with no arguments:

- a **model factory** returns a ``flax.linen.Module`` whose ``apply(variables, x)`` maps a batch of
  configurations ``x`` of shape ``(n, n_sites)`` to ``n`` log-amplitudes (shape ``(n,)``, real or
  complex), as NetKet's models do;
- a **system factory** returns a dict with the keys ``"hilbert"`` (a NetKet discrete Hilbert space) and
  ``"hamiltonian"`` (a NetKet operator on it), and optionally ``"graph"`` (a NetKet graph on its
  sites: the symmetric built-in models use its symmetries, and a constrained Hilbert space, such as
  ``total_sz=0``, is sampled by spin exchanges along its edges) and ``"exact_energy"`` (a number:
  then the run reports its relative error, otherwise the V-score).

The files are imported, the factories called and their results checked when the run starts, after
JAX's devices are set and before anything is sampled; each mistake is one line naming the option, what
was found, what was expected and the fix (status 2). The syntax of the option, and whether the file
or the top-level module exists, is checked by argparse, before anything is imported.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from . import _systems

#: The keys a system factory's dict may have; the first two are required.
SYSTEM_KEYS = ("hilbert", "hamiltonian", "graph", "exact_energy")
#: Samples in the batch the model is checked on (``jax.eval_shape``: nothing is computed).
CHECK_BATCH = 3


class UserProblemError(Exception):
    """A user's module, factory or its result is not usable; ``str`` is the one-line message."""

    def __init__(self, option: str, message: str):
        super().__init__(f"argument {option}: {message}")


def is_spec(value) -> bool:
    """Whether an option's value is ``MODULE:FACTORY`` rather than a built-in name."""
    return isinstance(value, str) and ":" in value


def option_type(builtin: tuple[str, ...], what: str) -> Callable[[str], str]:
    """An argparse type: one of ``builtin``, or ``MODULE:FACTORY`` whose file or top-level module exists
    (found without importing anything)."""

    def parse(text: str) -> str:
        if text in builtin:
            return text
        module, sep, factory = text.rpartition(":")
        expected = (
            f"one of {', '.join(builtin)}, or MODULE:FACTORY "
            f"(a dotted module or a .py file, and a {what} function in it)"
        )
        if not sep or not module or not factory.isidentifier():
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")
        if _is_file(module):
            if not module.endswith(".py"):
                raise argparse.ArgumentTypeError(
                    f"{module!r} is not a .py file (from {text!r}); expected {expected}"
                )
            if not Path(module).is_file():
                raise argparse.ArgumentTypeError(
                    f"no file {module!r} (from {text!r}); expected the path of a Python file, "
                    "relative to the current directory or absolute"
                )
            return text
        if not all(part.isidentifier() for part in module.split(".")):
            raise argparse.ArgumentTypeError(
                f"{module!r} is neither a dotted module name nor a .py file (from {text!r}); "
                f"expected {expected}"
            )
        top = module.split(".")[0]
        if top not in sys.modules and importlib.util.find_spec(top) is None:
            raise argparse.ArgumentTypeError(
                f"no module named {top!r} (from {text!r}) on this Python's path. Fix: install it, run "
                "from the folder that holds it, or give the path of its .py file"
            )
        return text

    return parse


def _is_file(module: str) -> bool:
    return module.endswith(".py") or "/" in module or "\\" in module


def _unique_name(path: Path) -> str:
    """The name a module file is imported under (its entry in ``sys.modules``: Python's own cache,
    so that ``--system`` and ``--model`` from one file run it once)."""
    return f"_vmcgrad_user_{path.stem}_{abs(hash(str(path))):x}"


def load_factory(spec: str, option: str) -> tuple[Callable, str]:
    """Imports ``MODULE`` of ``spec`` (once per process) and returns ``(factory, where)``, ``where`` the
    module's file for messages.

    Raises:
        UserProblemError: the import fails, or the module has no callable of that name.
    """
    module_name, _, name = spec.rpartition(":")
    key = str(Path(module_name).resolve()) if _is_file(module_name) else module_name
    module = sys.modules.get(_unique_name(Path(key))) if _is_file(module_name) else None
    if module is None:
        module = _import(module_name, key, option)
    where = getattr(module, "__file__", None) or module_name
    factory = getattr(module, name, None)
    if factory is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserProblemError(
            option,
            f"{module_name!r} has no {name!r}; its functions and classes: {', '.join(defined) or 'none'}. "
            f"Fix: MODULE:FACTORY with one of those names",
        )
    if not callable(factory):
        raise UserProblemError(
            option, f"{module_name}:{name} is a {type(factory).__name__}, not a function to call"
        )
    return factory, where


def _import(module_name: str, key: str, option: str):
    try:
        if _is_file(module_name):
            path = Path(key)
            unique = _unique_name(path)
            spec = importlib.util.spec_from_file_location(unique, path)
            if spec is None or spec.loader is None:
                raise UserProblemError(option, f"{module_name!r} cannot be loaded as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[unique] = module  # dataclasses (flax modules) look their module up here
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(unique, None)
                raise
            return module
        return importlib.import_module(module_name)
    except UserProblemError:
        raise
    except Exception as error:
        raise UserProblemError(
            option, f"importing {module_name!r} raised {_describe(error, key)}. Fix: run the file on its own"
        ) from None


def _describe(error: BaseException, where: str | None = None) -> str:
    """``TypeName: first line`` and, when the traceback passes through ``where``, ``(file, line N)``."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if where:
        target = str(Path(where).resolve()) if Path(where).exists() else None
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if target and Path(f.filename).resolve() == Path(target)
        ]
        if frames:
            text += f" ({frames[-1].filename}, line {frames[-1].lineno})"
    return text


def _call(factory: Callable, spec: str, option: str, where: str):
    try:
        return factory()
    except Exception as error:
        raise UserProblemError(
            option,
            f"calling {spec}() raised {_describe(error, where)} (a factory is called with no arguments)",
        ) from None


def build_system(spec: str) -> _systems.System:
    """The :class:`~._systems.System` of a system factory's dict (module docstring).

    Raises:
        UserProblemError: for an import, a call or a returned value that does not fit.
    """
    import netket as nk

    option = "--system"
    factory, where = load_factory(spec, option)
    made = _call(factory, spec, option, where)
    if not isinstance(made, dict):
        raise UserProblemError(
            option,
            f"{spec}() returned a {type(made).__name__}; expected a dict with the keys 'hilbert' and "
            "'hamiltonian' (and optionally 'graph', 'exact_energy'). Fix: "
            "return {'hilbert': hi, 'hamiltonian': H}",
        )
    unknown = sorted(set(made) - set(SYSTEM_KEYS), key=str)
    missing = [k for k in SYSTEM_KEYS[:2] if k not in made]
    if unknown or missing:
        problem = f"lacks {', '.join(map(repr, missing))}" if missing else f"has unknown keys {unknown}"
        raise UserProblemError(
            option, f"the dict of {spec}() {problem}; expected the keys {', '.join(map(repr, SYSTEM_KEYS))}"
        )
    hilbert, hamiltonian = made["hilbert"], made["hamiltonian"]
    graph, exact = made.get("graph"), made.get("exact_energy")
    if not isinstance(hilbert, nk.hilbert.DiscreteHilbert):
        raise UserProblemError(
            option,
            f"{spec}()['hilbert'] is a {type(hilbert).__name__}; expected a NetKet discrete Hilbert space, "
            "e.g. nk.hilbert.Spin(0.5, N=16)",
        )
    if not isinstance(hamiltonian, nk.operator.DiscreteOperator):
        raise UserProblemError(
            option,
            f"{spec}()['hamiltonian'] is a {type(hamiltonian).__name__}; expected a NetKet operator, "
            "e.g. nk.operator.Heisenberg(hilbert, graph)",
        )
    if hamiltonian.hilbert != hilbert:
        raise UserProblemError(
            option,
            f"{spec}()['hamiltonian'] acts on {hamiltonian.hilbert}, not on {spec}()['hilbert'] = {hilbert}. "
            "Fix: build the operator on that Hilbert space",
        )
    if graph is not None and (not isinstance(graph, nk.graph.AbstractGraph) or graph.n_nodes != hilbert.size):
        got = (
            f"a graph of {graph.n_nodes} nodes"
            if isinstance(graph, nk.graph.AbstractGraph)
            else f"a {type(graph).__name__}"
        )
        raise UserProblemError(
            option,
            f"{spec}()['graph'] is {got}; expected a NetKet graph of {hilbert.size} nodes (one per site)",
        )
    if exact is not None and (
        isinstance(exact, bool) or not isinstance(exact, (int, float)) or not math.isfinite(exact)
    ):
        raise UserProblemError(
            option, f"{spec}()['exact_energy'] is {exact!r}; expected a finite real number, or leave it out"
        )
    if hilbert.constrained and graph is None:
        raise UserProblemError(
            option,
            f"{spec}()['hilbert'] = {hilbert} has a constraint, so it is sampled by exchanges along "
            "a graph's edges: add 'graph' to the dict",
        )
    if hilbert.constrained:
        sampler = lambda n_chains: nk.sampler.MetropolisExchange(
            hilbert, graph=graph, n_chains=n_chains, d_max=1
        )
    else:
        sampler = lambda n_chains: nk.sampler.MetropolisLocal(hilbert, n_chains=n_chains)
    return _systems.System(
        hilbert,
        hamiltonian,
        sampler,
        hilbert.size,
        bonds=None,
        field=0.0,
        graph=graph,
        description=f"{spec}: {type(hamiltonian).__name__} on {hilbert}",
        exact=None if exact is None else float(exact),
    )


def build_model(spec: str, system: _systems.System):
    """The flax module of a model factory, checked on an abstract batch of :data:`CHECK_BATCH`
    configurations of ``system`` (``jax.eval_shape``: shapes only, nothing computed).

    Raises:
        UserProblemError: for an import, a call, a returned value or an output shape that does not fit.
    """
    import jax
    import jax.numpy as jnp

    option = "--model"
    factory, where = load_factory(spec, option)
    model = _call(factory, spec, option, where)
    if not (callable(getattr(model, "init", None)) and callable(getattr(model, "apply", None))):
        raise UserProblemError(
            option,
            f"{spec}() returned a {type(model).__name__}; expected a flax.linen.Module whose "
            "__call__(x) maps configurations of shape (n, n_sites) to n log-amplitudes, e.g. nk.models.RBM()",
        )
    key = jax.random.key(0)
    x = jax.eval_shape(lambda k: system.hilbert.random_state(k, CHECK_BATCH), key)
    try:
        variables = jax.eval_shape(model.init, key, x)
        out = jax.eval_shape(model.apply, variables, x)
    except Exception as error:
        raise UserProblemError(
            option,
            f"{spec}() fails on a batch of configurations of shape {tuple(x.shape)} ({x.dtype}): "
            f"{_describe(error, where)}",
        ) from None
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != (CHECK_BATCH,) or not jnp.issubdtype(dtype, jnp.inexact):
        got = f"shape {shape} ({dtype})" if shape is not None else f"a {type(out).__name__}"
        raise UserProblemError(
            option,
            f"{spec}() maps a batch of shape {tuple(x.shape)} to {got}; expected shape ({CHECK_BATCH},), "
            "one real or complex log-amplitude per sample. Fix: end __call__ with a reduction over the "
            "last axis, e.g. return jnp.sum(h, axis=-1)",
        )
    return model


def system_and_model(args):
    """The run's :class:`~._systems.System` and flax module: built-in, or from the user's factories;
    a usage error (one line, status 2) when the user's do not fit."""
    try:
        system = build_system(args.system) if is_spec(args.system) else _systems.build(args.system, args.L)
        if is_spec(args.model):
            return system, build_model(args.model, system)
        if args.model in ("rbm-symm", "gcnn") and system.graph is None:
            raise UserProblemError(
                "--model",
                f"{args.model} needs the lattice's symmetries: add 'graph' to {args.system}()'s dict",
            )
        return system, _systems.make_model(args.model, system)
    except UserProblemError as error:
        args._parser.error(str(error))
