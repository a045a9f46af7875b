r"""``VMC_SR``: NetKet's ``nk.driver.VMC_SR`` with the sample-space SR update computed by vmcgrad.

NetKet's ``VMC_SR`` calls module functions (``srt``, ``srt_onthefly``), not the state, so the
``MCState`` switch cannot reach it; this subclass replaces only the update of
:meth:`compute_loss_and_update`. With ``use_ntk=True`` every step computes

.. math::

    \delta\theta = \frac{1}{\sqrt N}\Delta J^\dagger
        \Big(T + \lambda\mathbb 1 + \frac{r}{N}\mathbf 1\mathbf 1^T\Big)^{-1} \varepsilon
        + \mu\,\delta_\mathrm{old},\qquad T = \frac1N \Delta J \Delta J^\dagger,

with :func:`vmcgrad.minsr_update` (NetKet's conventions, modes and SPRING momentum): the kernel is
built block by block from per-chunk Jacobians (never the N×P Jacobian NetKet holds, dense or on the
fly), at any ``chunk_size_bwd`` (no divisor needed) or ``"auto"``, and mapped back to parameter
space by one chunked pullback with one reduction. ``on_the_fly`` makes no difference to vmcgrad's
kernel (both are built without the Jacobian); it is kept for NetKet's interface. ``linear_solver``
is NetKet's dense solver on the N×N (2N×2N) kernel, or ``"cg"`` for vmcgrad's matrix-free conjugate
gradient on ``T @ v`` (no N×N matrix stored).

On a ``FullSumState`` (every configuration, weighted by :math:`|\psi|^2`) the driver runs, as NetKet's
does, the exact parameter-space SR update (NetKet's ``sr`` with the state's probabilities as weights):
the kernel has no samples there. ``use_ntk=False`` (parameter-space SR, a P×P matrix) on an ``MCState``
runs NetKet's own ``sr``: the P×P system is
the point of that path, and for it ``nk.driver.VMC`` with ``nk.optimizer.SR(qgt=
vmcgrad.netket.QGTOnTheFly)`` is vmcgrad's chunked route (no P×P or N×P matrix at all). The
driver warns once that this step is NetKet's.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import netket as nk
from netket.utils import struct, timing

import vmcgrad
from vmcgrad._problem import validation as check
from vmcgrad._sr.ntk import minsr, routes
from vmcgrad._sr.ntk import modes as ntk_modes

from . import _driver_state
from . import _nk_private as nkp
from ._grow import GrowSamples
from ._netket_chunked import warn_once
from ._update import CompiledUpdate, _minsr, _route_choice, _update

NAME = "vmcgrad.netket.VMC_SR"


class VMC_SR(nk.driver.VMC_SR):
    r"""NetKet's ``VMC_SR`` driver whose MinSR / SPRING update (``use_ntk=True``) is vmcgrad's.

    Same arguments as ``nk.driver.VMC_SR``, and:

    Args:
        chunk_size_bwd: rows and columns per block of the kernel on each device: any positive int,
            None, or ``"auto"`` (largest power of two whose program fits ``memory_budget``; on the
            dense route then fewer, larger chunks at the batch it fixes, or one block of every
            sample at a smaller batch, :func:`vmcgrad._sr.ntk.dense.choose_dense`).
            Default: the state's vmcgrad chunk size (``vmcgrad.netket.MCState``), else its
            ``chunk_size``.
        linear_solver: NetKet's dense solver ``solver(A, b)``, or ``"cg"`` (matrix-free).
        memory_budget: bytes per device for ``chunk_size_bwd="auto"`` (default: the state's
            ``memory_budget``; a budget with no chunk given means ``"auto"``); with ``grow_samples`` and a
            dense solver, also the cap on N: some route's compiled update must fit it (on
            ``route="dense"`` the N×N kernel and its factor, :math:`2 (kN)^2` numbers, :math:`k = 2` in
            the 'complex' mode). Where no route fits, not even matrix-free CG, the step stops before
            sampling with a MemoryError naming a ``memory_budget=`` and an ``n_samples=`` that fit.
        route: the update's route (:func:`vmcgrad.minsr_update`): ``"dense"`` (the N×N kernel in blocks),
            ``"parameter"`` (the P×P matrix: the cheaper dense system when P < N·K), ``"cg"``
            (matrix-free, Nyström-preconditioned), or None: at each N, before sampling, the route of least
            modelled time whose compiled update fits ``memory_budget`` (:meth:`route_at`,
            :func:`vmcgrad._sr.ntk.routes.choose`). The route taken is logged each step as
            ``minsr_route`` with the update's seconds as ``minsr_update_time``, the time the rule
            modelled for it as ``minsr_modelled_time`` on the platform ``minsr_cost_platform`` (the
            record, every route's modelled time, in :attr:`route_choice`), and CG's iterations as
            ``cg_iterations``; the route is kept in :attr:`route`.
        grow_samples: a :class:`GrowSamples` rule: N is multiplied by its ``factor`` (a multiple of
            the sampler's chains) whenever the energy has settled to its error bar over its
            ``window`` of steps, up to its ``max_samples`` and to what ``memory_budget`` holds (the
            raise is halved until the update's compiled program at the new N fits it, but not below
            :meth:`GrowSamples.worth`; once no raise is made, N stays). Each step logs
            ``n_samples``; :attr:`grown` lists the raises as ``(step, old N, new N)``.

    Example::

        vs = vmcgrad.netket.MCState(sampler, model, n_samples=4096, chunk_size=256)
        gs = vmcgrad.netket.VMC_SR(H, optax.sgd(0.01), diag_shift=1e-4, variational_state=vs,
                                   use_ntk=True)
        gs.run(300)
    """

    _cg: bool = struct.field(pytree_node=False, default=False)
    _memory_budget: Any = struct.field(pytree_node=False, default=None)
    _grow: Any = struct.field(pytree_node=False, default=None)
    _grow_history: Any = struct.field(pytree_node=False, default=None)
    grown: Any = struct.field(pytree_node=False, default=None)
    _grow_stopped: bool = struct.field(pytree_node=False, default=False)
    _n_sampled: Any = struct.field(pytree_node=False, default=None)
    _route: Any = struct.field(pytree_node=False, default=None)
    route: Any = struct.field(pytree_node=False, default=None)
    _cg_iterations: Any = struct.field(pytree_node=False, default=None)
    _run_update: Any = struct.field(pytree_node=False, default=None)
    _routes: Any = struct.field(pytree_node=False, default=None)
    _update_time: Any = struct.field(pytree_node=False, default=None)
    _online_made: Any = struct.field(pytree_node=False, default=None)
    route_choice: Any = struct.field(pytree_node=False, default=None)

    def __init__(
        self,
        hamiltonian: Any,
        optimizer: Any,
        *,
        variational_state: Any,
        chunk_size_bwd: int | str | None = None,
        linear_solver: Any = nk.optimizer.solver.cholesky_with_fallback,
        memory_budget: float | None = None,
        grow_samples: GrowSamples | None = None,
        route: str | None = None,
        **kwargs: Any,
    ):
        if isinstance(variational_state, nk.vqs.FullSumState) and kwargs.get("use_ntk"):
            raise ValueError(
                f"{NAME}: use_ntk=True needs a sampled state (the sample-space kernel is defined on "
                "samples); got a FullSumState. Fix: leave out use_ntk (or pass False): on a FullSumState "
                "the driver runs the exact parameter-space SR update, as NetKet's does."
            )
        if grow_samples is not None and not isinstance(grow_samples, GrowSamples):
            raise TypeError(
                f"{NAME}: `grow_samples` must be a vmcgrad.netket.GrowSamples or None; got "
                f"{type(grow_samples).__name__}. Fix: "
                "grow_samples=vmcgrad.netket.GrowSamples(max_samples=8192)."
            )
        if grow_samples is not None and not isinstance(variational_state, nk.vqs.MCState):
            raise TypeError(
                f"{NAME}: `grow_samples` needs a sampled state (an MCState); got "
                f"{type(variational_state).__name__}, which has no number of samples to raise."
            )
        chunk = check.check_chunk_size(NAME, chunk_size_bwd)
        budget = check.check_memory_budget(NAME, memory_budget)
        if budget is None:  # one budget: the state's
            budget = getattr(variational_state, "vmcgrad_memory_budget", None)
        if chunk is None:
            chunk = getattr(variational_state, "vmcgrad_chunk_size", None)
            if chunk is None:
                chunk = "auto" if budget is not None else variational_state.chunk_size
        use_cg = isinstance(linear_solver, str)
        if use_cg and linear_solver != "cg":
            raise ValueError(
                f"{NAME}: `linear_solver` must be a dense solver solver(A, b) or 'cg'; got {linear_solver!r}."
            )
        routes.check_route(NAME, route, "cg" if use_cg else None)
        super().__init__(
            hamiltonian,
            optimizer,
            variational_state=variational_state,
            linear_solver=linear_solver,
            chunk_size_bwd=chunk if isinstance(chunk, int) else None,
            **kwargs,
        )
        self._cg = use_cg
        if self._cg and not self.use_ntk:
            raise ValueError(f"{NAME}: linear_solver='cg' needs use_ntk=True (the sample-space update).")
        if grow_samples is not None and not self.use_ntk:
            raise ValueError(
                f"{NAME}: `grow_samples` needs use_ntk=True (the sample-space update, whose kernel holds "
                "N within the budget); got use_ntk=False. Fix: pass use_ntk=True."
            )
        if not self.use_ntk and not isinstance(chunk, int):  # NetKet's own step: its chunk or none
            chunk = variational_state.chunk_size if isinstance(variational_state.chunk_size, int) else None
        self._chunk_size_bwd = chunk  # may be "auto", which NetKet's setter refuses
        self._memory_budget = budget
        if self.use_ntk:
            # vmcgrad's SPRING buffer: a pytree like the parameters (None: zeros).
            self._old_updates = None
        self._grow, self._grow_history, self.grown = grow_samples, [], []
        self._grow_stopped = False
        self._route = route
        self._routes = {}  # N -> (the route taken there, its record: vmcgrad._chunks.budget.Choice)
        self._update_time = None
        self._online_made = None  # the online statistics this driver last made (see a step)
        self.route_choice = None
        self._run_update = CompiledUpdate()  # each step's update: the choice's executable

    @timing.timed
    def compute_loss_and_update(self):
        """The energy statistics and vmcgrad's sample-space update (NetKet's step if ``use_ntk=False``)."""
        if not self.use_ntk:
            if not isinstance(self.state, nk.vqs.FullSumState):  # (there: nothing to chunk)
                _warn_netket_step()
            return super().compute_loss_and_update()
        route = self.route_at(self.state.n_samples)  # before sampling: a budget no route fits stops here
        local_energies = self.state.local_estimators(self._ham)
        self._loss_stats = nk.stats.statistics(local_energies)
        decay = self._mcmc_convergence_diagnostics_ema_decay
        if decay is not None:
            old = self._loss_stats_online
            # NetKet's rule: an empty accumulator (the driver's first, or one loaded) is built again.
            # One this driver's last step made holds that step's samples: its count is not read (an
            # op, and a wait for the device, every step)
            if old is not None and old is not self._online_made and old.n_samples == 0:
                old = None
            self._loss_stats_online = self._online_made = nk.stats.online_statistics(
                local_energies, old_estimator=old, decay=decay, max_lag=32
            )
        # the samples (chains, per chain, ...) and their local energies as they are: the update's
        # jitted preparation takes them to rows (no op of its own each step)
        args, static = self._update_arguments(self.state.samples, local_energies, route)
        self.route, self.route_choice = route, self.route_choice_at(self.state.n_samples)
        start = time.perf_counter()
        self._dp, self._old_updates, info = jax.block_until_ready(self._run_update(args, static))
        self._update_time = time.perf_counter() - start
        self._cg_iterations = int(info.iterations) if isinstance(info, vmcgrad.CGInfo) else None
        self.info = info if isinstance(info, dict) and info else None
        self._n_sampled = self.state.n_samples
        self._grow_samples()
        return self._loss_stats, self._dp

    def _grow_samples(self) -> None:
        """Applies the ``grow_samples`` rule after this step's update: the next step samples the raised N."""
        if self._grow is None or self._grow_stopped:
            return
        stats = self._loss_stats
        self._grow_history.append((float(jax.numpy.real(stats.mean)), float(stats.error_of_mean)))
        energies, errors = zip(*self._grow_history)
        if not self._grow.settled(energies, errors):
            return
        n, granule = self.state.n_samples, self.state.sampler.n_chains
        new = self._grow.next_n(n, granule)
        cap = self.max_samples_in_budget()
        if new is not None and cap is not None and new > cap:
            new = cap - cap % granule
        # halve the raise until the program fits, down to the smallest raise worth its compilations
        while new is not None and self._grow.worth(n, new) and not self._update_fits(new):
            new = n + (new - n) // 2 // granule * granule
        if new is None or not self._grow.worth(n, new):
            self._grow_stopped = True  # at max_samples, or at what the budget holds: N stays from here on
            return
        self.state.n_samples = new
        self._grow_history = []  # W more steps at the new N before the next decision
        self.grown.append((int(self.step_count), int(n), int(new)))

    def _update_fits(self, n: int) -> bool:
        """Whether the update at N = ``n`` fits ``memory_budget`` (True without a budget): some route
        fits (:meth:`route_at`), and a route the caller fixed has its compiled program (not run, on
        abstract samples sharded like the state's) within the budget."""
        if self._memory_budget is None:
            return True
        try:
            route = self._route_rule(n)
        except routes.NoRouteFits:
            return False
        if self._route is None and not self._cg:
            return True  # the rule compiled it within the budget
        args, static = self._update_arguments(*self._abstract_rows(n), route)
        try:
            compiled = _update.lower(*args, **static).compile()
        except MemoryError:  # chunk_size="auto" found no chunk that fits
            return False
        return vmcgrad.program_bytes(compiled) <= self._memory_budget

    def route_at(self, n: int) -> str:
        """The update's route at N = ``n``: the one given (``route=``, ``linear_solver="cg"``), else
        the fastest that fits ``memory_budget`` (:func:`vmcgrad._sr.ntk.routes.choose`; compile only,
        on abstract samples, before anything is sampled; cached per N).

        Raises:
            MemoryError: when no route fits the budget at this N, in this driver's terms.
        """
        try:
            return self._route_rule(n)
        except routes.NoRouteFits as err:
            raise self._no_route(n, err) from None

    def route_choice_at(self, n: int) -> Any:
        """The record of the update's route at N = ``n`` (:func:`vmcgrad._sr.ntk.minsr.update_choice`):
        a :class:`vmcgrad._chunks.budget.Choice` whose ``value`` is ``(route, chunk)``, ``seconds`` its
        modelled time on ``platform`` (:func:`vmcgrad.program_cost` of its compiled program, CG at
        :data:`vmcgrad._sr.ntk.routes.CG_ITERATIONS` iterations) and ``priced`` each route that fits
        with its own; for a route given, that route priced alone (None where it does not fit).
        Compile only, on abstract samples; cached per N.

        Raises:
            MemoryError: when the rule chooses and no route fits the budget at this N.
        """
        try:
            return self._priced(n)[1]
        except routes.NoRouteFits as err:
            raise self._no_route(n, err) from None

    def _route_rule(self, n: int) -> str:
        """:meth:`route_at`, raising :class:`vmcgrad._sr.ntk.routes.NoRouteFits` as the core does."""
        fixed = routes.check_route(NAME, self._route, "cg" if self._cg else None)
        if fixed is not None and n not in self._routes:
            return fixed  # (priced only when a step or route_choice_at asks)
        return self._priced(n)[0]

    def _priced(self, n: int) -> tuple[str, Any]:
        """``(route, record)`` at N = ``n``, cached: the rule's, or a given route priced alone."""
        if n not in self._routes:
            fixed = routes.check_route(NAME, self._route, "cg" if self._cg else None)
            args, static = self._update_arguments(*self._abstract_rows(n), fixed)
            chosen = []
            jax.eval_shape(lambda *a: chosen.append(_route_choice(*a, **static)), *args)
            choice = chosen[0]
            self._routes[n] = (fixed if choice is None else choice.value[0], choice)
        return self._routes[n]

    def _no_route(self, n: int, err: routes.NoRouteFits) -> MemoryError:
        """The error for a budget no route fits at N = ``n``: the budget that holds it, and the largest
        N this budget holds (halving N, in multiples of the chains; :meth:`_fits_at_all`: one
        compilation per N that fits no route, not a route's choice)."""
        granule = self.state.sampler.n_chains
        smaller = n // 2 // granule * granule
        while smaller >= granule and not self._fits_at_all(smaller):
            smaller = smaller // 2 // granule * granule
        fewer = f", or at most n_samples={smaller}" if smaller >= granule else ""
        out = MemoryError(
            f"{NAME}: no route of the sample-space SR update fits memory_budget={self._memory_budget} "
            f"bytes per device at n_samples={n}: the smallest, matrix-free CG, needs {err.need} at one "
            f"sample per chunk. Fix: pass memory_budget={routes.enough(err.need)}{fewer} at this budget."
        )
        out.need, out.budget, out.n, out.max_samples = err.need, err.budget, n, smaller or None
        return out

    def _fits_at_all(self, n: int) -> bool:
        """Whether the update at N = ``n`` fits ``memory_budget`` on some route (the one given, else
        any) at some chunk (True without a budget): :func:`vmcgrad._sr.ntk.minsr.update_fits`, on
        abstract samples; compile only, a route's program at one sample per chunk, the route not
        chosen (the step at that N chooses it, as :meth:`route_at`)."""
        if self._memory_budget is None:
            return True
        fixed = routes.check_route(NAME, self._route, "cg" if self._cg else None)
        args, static = self._update_arguments(*self._abstract_rows(n), fixed)
        found = []
        jax.eval_shape(lambda *a: found.append(_minsr(minsr.update_fits, *a, **static)), *args)
        return found[0]

    def _abstract_rows(self, n: int) -> tuple[Any, Any]:
        """Samples and local energies at N = ``n`` as shapes, laid out as the state's (nothing sampled)."""
        sigma = getattr(self.state.sampler_state, "σ", None)  # the chains' configurations: no sampling
        samples = self.state.samples if sigma is None else sigma
        sharding = getattr(samples, "sharding", None)
        rows = jax.ShapeDtypeStruct((n, samples.shape[-1]), samples.dtype, sharding=sharding)
        if getattr(self, "_loss_stats", None) is not None:
            dtype = jax.numpy.asarray(self._loss_stats.mean).dtype
        else:  # NetKet's local energies: the operator's entries times ratios of the model's outputs
            out = jax.eval_shape(nkp.apply_fun(self.state), self.state.variables, rows)
            dtype = jax.numpy.result_type(self._ham.dtype, out.dtype)
        return rows, jax.ShapeDtypeStruct((n,), dtype, sharding=sharding)

    def _solver(self) -> Any:
        return "cg" if self._cg else self._linear_solver

    def _update_arguments(self, samples: Any, local_energies: Any, route: str | None) -> tuple[tuple, dict]:
        """The arguments of :func:`_update` at these samples (arrays, or their shapes at a raised N;
        any leading axes, the last the sites') on ``route``: the hyperparameters at this step
        (schedules evaluated) as given, numbers or 0-d arrays, checked here (traced, their values
        cannot be) and made arrays only by the jitted update (a Python number and ``jnp.asarray`` of
        it trace alike), so that a step, :meth:`route_at` and :meth:`_update_fits` trace the same
        program."""
        named = {"diag_shift": self.diag_shift, "proj_reg": self.proj_reg, "momentum": self.momentum}
        named = {k: h(self.step_count) if callable(h) else h for k, h in named.items()}
        hyper = [None if h is None else check.check_nonnegative_number(NAME, k, h) for k, h in named.items()]
        momentum = named["momentum"]
        old = self._old_updates if momentum is not None else None
        args = (self.state.model_state, self.state.parameters, samples, local_energies, *hyper, old)
        static = dict(
            apply_fun=nkp.apply_fun(self.state),
            mode=str(self.mode),  # NetKet's JacobianMode
            solver=self._solver(),
            route=route,
            chunk_size=self.chunk_size_bwd,
            memory_budget=self._memory_budget,
            # what the update's trace reads of the platform the choices are made for: jax.jit keys
            # its trace by this, so that a step priced for another platform is that platform's program
            platform=ntk_modes.platform_key(),
        )
        return args, static

    def max_samples_in_budget(self) -> int | None:
        """An upper bound on the N whose update fits ``memory_budget`` where the dense kernel is the
        route (``route="dense"``): the N×N kernel and its factor alone must fit, :math:`2 (NK)^2`
        numbers (:func:`vmcgrad._sr.ntk.routes.system_sizes`). None otherwise: with no budget, or
        where the rule may take the matrix-free route, whose floor grows only linearly in N; a raise
        is then checked on the compiled programs themselves (:meth:`_update_fits`)."""
        if self._memory_budget is None or self._route != "dense" or not self.use_ntk:
            return None
        nk, _, itemsize = routes.system_sizes(str(self.mode), 1, self.state.parameters)
        return int((self._memory_budget / (2 * itemsize)) ** 0.5) // nk

    def state_dict(self) -> dict:
        """Everything this driver needs to continue a run, beyond its variational state.

        A dict (a pytree of arrays, numbers, lists and bools, ready for
        :func:`flax.serialization.msgpack_serialize` once its arrays are on the host):

        - ``"step_count"``: the steps done (:attr:`step_count`; schedules are evaluated at it);
        - ``"optimizer_state"``: the optimizer's state, as :func:`flax.serialization.to_state_dict`;
        - ``"n_samples"``: the state's number of samples (``grow_samples`` may have raised it), or None
          for a ``FullSumState``;
        - ``"grow"``: the ``grow_samples`` rule's window of ``(energy, error)`` pairs (``"history"``),
          its raises (``"grown"``, as :attr:`grown`) and whether it stopped raising (``"stopped"``);
        - ``"old_updates"``: SPRING's last update (a pytree like the parameters), or None.

        The variational state itself (``variables``, ``sampler_state``) is saved through its own
        attributes. :meth:`load_state_dict` puts the dict back into a driver built with the same
        arguments; with the same variational state the run then continues bit for bit.
        """
        return _driver_state.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Puts a :meth:`state_dict` back into this driver (in place).

        Arrays may be NumPy arrays (as read from a file): each is placed like the driver's own (the
        same sharding). Set the variational state's ``variables`` and ``sampler_state`` as well
        (after this call: ``n_samples`` is set here, which resets the state's samples).

        Raises:
            ValueError: naming the entry, when ``state`` lacks one or an array does not fit this
                driver's (another model or optimizer).
        """
        _driver_state.load_state_dict(self, state)

    def _log_additional_data(self, log_dict: dict):
        super()._log_additional_data(log_dict)
        if self.use_ntk and self.route is not None:
            log_dict["minsr_route"] = self.route
            log_dict["minsr_update_time"] = self._update_time  # seconds of the update, beside its route
            if self.route_choice is not None:  # the time the rule modelled for it, and for what platform
                log_dict["minsr_modelled_time"] = self.route_choice.seconds
                log_dict["minsr_cost_platform"] = self.route_choice.platform
            if self._cg_iterations is not None:
                log_dict["cg_iterations"] = self._cg_iterations
        if self._grow is not None:
            log_dict["n_samples"] = self._n_sampled  # this step's N (the next one may be raised)


def _warn_netket_step() -> None:
    warn_once(
        (NAME, "use_ntk=False"),
        f"{NAME}(use_ntk=False) runs NetKet's own parameter-space SR step (a P×P matrix). For "
        "vmcgrad's chunked parameter-space SR use nk.driver.VMC with "
        "nk.optimizer.SR(qgt=vmcgrad.netket.QGTOnTheFly).",
        stacklevel=3,
    )
