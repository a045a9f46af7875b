"""The compiled bytes of each program of ``vmcgrad vmc --driver sr``'s QGT phase on the 2-D GCNN
(heisenberg2d, its default model and samples, one device), at a budget and the product's chunk: O-bar's
pass, the product (pytree and flat), the program that builds the operator and applies it once (what
the log measured before), and NetKet's solve as ``nk.optimizer.SR`` runs it. Figures:
docs/performance.md ("``vmcgrad vmc`` at a budget on the built-in systems").

    python benchmarks/qgt_phase_bytes.py 16MiB 512
"""

import sys

import jax
import netket as nk

import vmcgrad
import vmcgrad.netket as vnk
from vmcgrad._problem.problem import compile_only
from vmcgrad._sr.qgt.apply import matmul_program
from vmcgrad._sr.qgt.qgt import _mean_program
from vmcgrad.cli import _phases, _systems, _user_problem, build_parser
from vmcgrad.netket._qgt import _solve


def main(budget_text: str, chunk: int) -> None:
    argv = ["vmc", "--system", "heisenberg2d", "--model", "gcnn", "--driver", "sr"]
    args = build_parser().parse_args([*argv, "--memory-budget", budget_text])
    _systems.fill_defaults(args)
    system, model = _user_problem.system_and_model(args)
    vstate = vnk.MCState(
        system.make_sampler(16), model, n_samples=args.samples, n_discard_per_chain=8, seed=1
    )
    budget, shift = args.memory_budget, args.diag_shift
    logpsi, w = _phases.log_psi(vstate), vstate.parameters
    x = _phases.stand_in_samples(vstate, vstate.n_samples)
    xa = _phases.abstract_samples(vstate, vstate.n_samples)
    S = vmcgrad.QGT(logpsi, w, x, chunk_size=chunk, design="fused", diag_shift=shift, memory_budget=budget)
    rep = jax.ShapeDtypeStruct((S.dim,), S.views.rep_dtype)

    def built(w, x):
        return vmcgrad.QGT(logpsi, w, x, chunk_size=chunk, design="fused", diag_shift=shift) @ w

    qgt = vnk.QGTOnTheFly(vstate, chunk_size=chunk, design="fused", diag_shift=shift)
    solver = jax.tree_util.Partial(nk.optimizer.SR(diag_shift=shift).solver)
    programs = {
        "O-bar's pass": compile_only(_mean_program, S.problem, S),
        "product (pytree)": compile_only(matmul_program, S.problem, S, w, "tree"),
        "product (flat)": compile_only(matmul_program, S.problem, S, rep, "rep"),
        "built and applied once": jax.jit(built).lower(w, xa).compile(),
        "NetKet's solve": _solve.lower(qgt, solver, w, x0=None).compile(),
    }
    print(f"budget {budget} bytes, P = {vstate.n_parameters}, N = {vstate.n_samples}, chunk {chunk}")
    for name, compiled in programs.items():
        print(f"{name}: {vmcgrad.program_bytes(compiled)} bytes")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
