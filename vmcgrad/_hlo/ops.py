"""One optimized-HLO instruction at a time: its parts, and the FLOPs and bytes it costs.

The rules (which ops are free, which move data, the FLOP formulas of ``dot``, ``convolution`` and
``fft``, the bytes of slices and in-place updates) are :mod:`vmcgrad._hlo.cost`'s, documented
there; this module applies them to one instruction, and :mod:`vmcgrad._hlo.cost` weights them by
how often each runs.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from vmcgrad._hlo.collectives import _CALLS, _parse

# --- one HLO instruction ------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+[a-z0-9]*)\[([^\]]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DIMS = {
    "lhs_contracting_dims": re.compile(r"lhs_contracting_dims=\{([\d,]*)\}"),
    "fft_length": re.compile(r"fft_length=\{([\d,]*)\}"),
    "dimensions": re.compile(r"dimensions=\{([\d,]*)\}"),
}
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")
_WINDOW_SIZE = re.compile(r"window=\{[^}]*size=([\dx]+)")
_FFT_TYPE = re.compile(r"fft_type=(\w+)")
#: A dense factorisation or triangular solve by LAPACK (XLA:CPU) or cuSOLVER / cuBLAS (XLA:GPU):
#: ``lapack_dpotrf_ffi``, ``cusolver_potrf_ffi``, ``lapack_ztrsm_ffi``, ...
_SOLVER = re.compile(
    r'custom_call_target="(?:lapack_[sdcz]|cusolver_|cublas_)?(potrf|getrf|syevd|heevd|trsm)\w*"'
)
#: FLOPs of a factorisation of an n x n matrix, in units of n³ (real): Cholesky n³/3, LU 2n³/3, a
#: symmetric eigendecomposition with vectors about 9n³ (Golub and Van Loan, *Matrix Computations*,
#: 4th ed., §8.3: tridiagonal reduction and the accumulated QR iteration).
_FACTOR_N3 = {"potrf": 1 / 3, "getrf": 2 / 3, "syevd": 9.0, "heevd": 9.0}
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')

_FREE = frozenset(
    {
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "bitcast",
        "opt-barrier",
        "after-all",
        "add-dependency",
        "domain",
        "partition-id",
        "replica-id",
    }
)
_MOVE = frozenset(
    {
        "copy",
        "copy-start",
        "broadcast",
        "reshape",
        "transpose",
        "slice",
        "dynamic-slice",
        "dynamic-update-slice",
        "concatenate",
        "pad",
        "gather",
        "convert",
        "bitcast-convert",
        "iota",
        "reverse",
        "all-gather",
        "all-gather-start",
        "all-to-all",
        "collective-permute",
        "collective-permute-start",
        "collective-broadcast",
        "send",
        "recv",
        "infeed",
        "outfeed",
        "rng-get-and-update-state",
        "rng-bit-generator",
        "get-dimension-size",
        "set-dimension-size",
    }
)


class _Instr(NamedTuple):
    name: str
    type: str  # the result's type: an array or a tuple of them
    opcode: str
    operands: tuple[str, ...]  # operand names (``parameter``: its number; ``constant``: its literal)
    attrs: str  # everything after the operands
    is_root: bool = False


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    name, rest = m.group(2), m.group(3)
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    type_, rest = rest[:end], rest[end:].lstrip()
    op = _OPCODE.match(rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    args, attrs = rest[op.end() : close - 1], rest[close:]
    if op.group(1) in ("parameter", "constant"):  # its number, or its literal
        operands = (args.strip(),)
    else:
        operands = tuple(_OPERAND.findall(args))
    return _Instr(name, type_, op.group(1), operands, attrs, bool(m.group(1)))


def _arrays(type_: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(type_):
        out.append((dtype, tuple(int(re.sub(r"\D", "", d) or 0) for d in dims.split(",") if d.strip())))
    return out


def _itemsize(dtype: str) -> float:
    if dtype == "token":
        return 0.0
    if dtype == "pred":
        return 1.0
    bits = re.match(r"[a-z]+(\d+)", dtype)
    return int(bits.group(1)) / 8 if bits else 0.0


def _elements(type_: str) -> int:
    return sum(math.prod(dims) for _, dims in _arrays(type_))


def _solver_flops(kind: str, lhs: list, last: str) -> float:
    """FLOPs of a LAPACK / cuSOLVER call on the matrices ``lhs`` (its first operand, batched over the
    leading dimensions): :data:`_FACTOR_N3` times n³ per matrix, a triangular solve n multiply-adds
    per entry of its right-hand sides (``last``, its last operand); complex 4 times as many."""
    dtype, dims = lhs[0]
    if len(dims) < 2:
        return 0.0
    n, batch = dims[-1], math.prod(dims[:-2])
    cplx = 4.0 if dtype.startswith("c") else 1.0
    if kind == "trsm":  # each right-hand side's n entries, n multiply-adds each (left or right side)
        return float(_elements(last) * n) * cplx
    return float(batch * _FACTOR_N3[kind] * n**3) * cplx


def _nbytes(type_: str) -> float:
    return sum(math.prod(dims) * _itemsize(dt) for dt, dims in _arrays(type_))


def _ints(pattern: re.Pattern, text: str) -> tuple[int, ...]:
    m = pattern.search(text)
    return tuple(int(d) for d in m.group(1).split(",") if d.strip()) if m else ()


def _complex(type_: str) -> bool:
    return any(dt.startswith("c") for dt, _ in _arrays(type_))


# --- a program --------------------------------------------------------------------------------


#: Ops that read a part of their first operand: their bytes are the part's (read and written).
_SLICES = ("slice", "dynamic-slice", "gather")


class OpCosts:
    """The computations of one HLO module, parsed once, and the FLOPs and bytes of each op."""

    def __init__(self, text: str):
        comps, self.entry = _parse(text)
        self.comps: dict[str, list[_Instr]] = {}
        for name, lines in comps.items():
            self.comps[name] = [i for i in map(_instr, lines) if i is not None]
        self.table = {name: {i.name: i for i in instrs} for name, instrs in self.comps.items()}
        self._flops: dict[str, float] = {}

    def root(self, comp: str) -> _Instr | None:
        instrs = self.comps.get(comp, [])
        return next((i for i in instrs if i.is_root), instrs[-1] if instrs else None)

    # --- a loop's trip count, read from its condition and body (TPU programs carry none) ----------

    def _value(self, comp: str, name: str) -> tuple[str, int] | None:
        """``("const", v)``, ``("gte", i)`` (element i of the computation's tuple parameter) or
        ``("param", k)`` (parameter k), through copies, bitcasts and converts; else None."""
        j = self.table.get(comp, {}).get(name)
        while j is not None and j.opcode in ("copy", "bitcast", "convert", "reshape") and j.operands:
            j = self.table[comp].get(j.operands[0])
        if j is None:
            return None
        if j.opcode == "constant":
            try:
                return ("const", int(float(j.operands[0])))
            except ValueError:
                return None
        if j.opcode == "parameter" and j.operands[0].isdigit():
            return ("param", int(j.operands[0]))
        index = re.search(r"index=(\d+)", j.attrs)
        if j.opcode == "get-tuple-element" and index:
            source = self.table[comp].get(j.operands[0])
            if source is not None and source.opcode == "parameter":
                return ("gte", int(index.group(1)))
        return None

    def _node(self, comp: str, name: str) -> tuple[str, str, list] | None:
        """The opcode, attributes and operand values of ``name``, looking into a fusion's root."""
        j = self.table.get(comp, {}).get(name)
        if j is None:
            return None
        if j.opcode != "fusion":
            return j.opcode, j.attrs, [self._value(comp, o) for o in j.operands]
        callee = _CALLS.findall(j.attrs)[:1]
        r = self.root(callee[0]) if callee else None
        if r is None:
            return None
        values = []
        for o in r.operands:
            v = self._value(callee[0], o)
            if v is not None and v[0] == "param" and v[1] < len(j.operands):
                v = self._value(comp, j.operands[v[1]])
            values.append(v)
        return r.opcode, r.attrs, values

    def loop_trips(self, loop: _Instr, comp: str) -> int | None:
        """The trip count of a ``while`` whose condition compares a counter with a constant
        (``i < n``, ``<=``, ``>``, ``>=``), the counter starting at a constant and the body adding a
        constant to it: how ``fori_loop`` and ``scan`` compile. None for any other loop."""
        body = re.search(r"body=%?([\w.\-]+)", loop.attrs)
        cond = re.search(r"condition=%?([\w.\-]+)", loop.attrs)
        init = self.table.get(comp, {}).get(loop.operands[0]) if loop.operands else None
        root = self.root(cond.group(1)) if cond else None
        if body is None or root is None or init is None or init.opcode != "tuple":
            return None
        node = self._node(cond.group(1), root.name)
        direction = re.search(r"direction=(\w+)", node[1]) if node and node[0] == "compare" else None
        if direction is None or len(node[2]) != 2 or None in node[2]:
            return None
        (ka, a), (kb, b) = node[2]
        flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
        if ka == "gte" and kb == "const":
            index, bound, d = a, b, direction.group(1)
        elif kb == "gte" and ka == "const":
            index, bound, d = b, a, flip.get(direction.group(1), "")
        else:
            return None
        start = self._value(comp, init.operands[index]) if index < len(init.operands) else None
        out = self.root(body.group(1))
        if start is None or start[0] != "const" or out is None or out.opcode != "tuple":
            return None
        step = self._node(body.group(1), out.operands[index]) if index < len(out.operands) else None
        if step is None or step[0] not in ("add", "subtract") or ("gte", index) != step[2][0]:
            return None
        if step[2][1] is None or step[2][1][0] != "const":
            return None
        s = step[2][1][1] * (1 if step[0] == "add" else -1)
        n = (bound - start[1]) if s > 0 else (start[1] - bound)
        if s == 0 or d not in (("LT", "LE") if s > 0 else ("GT", "GE")):
            return None
        trips = -(-n // abs(s)) if d in ("LT", "GT") else n // abs(s) + 1
        return max(trips, 0)

    # FLOPs of a computation's instructions (a fusion's body, recursively)
    def comp_flops(self, comp: str) -> float:
        if comp not in self._flops:
            self._flops[comp] = sum(self.flops(i, comp) for i in self.comps.get(comp, ()))
        return self._flops[comp]

    def operand_type(self, comp: str, name: str) -> str:
        i = self.table.get(comp, {}).get(name)
        return i.type if i is not None else ""

    def flops(self, i: _Instr, comp: str) -> float:
        op = i.opcode
        if op in _FREE or op in _MOVE or op.endswith("-done") or op.endswith("-update"):
            return 0.0
        if op == "fusion":
            return sum(self.comp_flops(c) for c in _CALLS.findall(i.attrs))
        out = _elements(i.type)
        cplx = 4.0 if _complex(i.type) else 1.0
        if op == "dot":
            lhs = _arrays(self.operand_type(comp, i.operands[0])) if i.operands else []
            dims = lhs[0][1] if lhs else ()
            k = math.prod(dims[d] for d in _ints(_DIMS["lhs_contracting_dims"], i.attrs) if d < len(dims))
            return 2.0 * out * k * cplx
        if op == "convolution":
            kernel = _arrays(self.operand_type(comp, i.operands[1])) if len(i.operands) > 1 else []
            labels = _DIM_LABELS.search(i.attrs)
            if not kernel or labels is None or "o" not in labels.group(1):
                return 2.0 * out * cplx
            dims = kernel[0][1]
            per_out = math.prod(dims) / max(dims[labels.group(1).index("o")], 1)
            return 2.0 * out * per_out * cplx
        if op == "fft":
            n = math.prod(_ints(_DIMS["fft_length"], i.attrs)) or 1
            kind = _FFT_TYPE.search(i.attrs)
            real = kind is not None and kind.group(1) in ("RFFT", "IRFFT")
            big = max(_elements(i.type), _elements(self.operand_type(comp, i.operands[0])))
            transforms = big / n if not real else math.ceil(big / (n // 2 + 1))
            return (2.5 if real else 5.0) * n * math.log2(max(n, 2)) * transforms
        if op == "custom-call":
            contract = _GEMM_CONTRACT.search(i.attrs)
            lhs = _arrays(self.operand_type(comp, i.operands[0])) if i.operands else []
            solver = _SOLVER.search(i.attrs)
            if solver is not None and lhs:
                return _solver_flops(solver.group(1), lhs, self.operand_type(comp, i.operands[-1]))
            if contract is None or not lhs:
                return 0.0
            dims = lhs[0][1]
            idx = [int(d.strip().strip('"')) for d in contract.group(1).split(",") if d.strip()]
            result = _arrays(i.type)
            n_out = math.prod(result[0][1]) if result else out
            return 2.0 * n_out * math.prod(dims[d] for d in idx if d < len(dims)) * cplx
        if op in ("reduce", "all-reduce", "all-reduce-start", "reduce-scatter"):
            inputs = i.operands[: max(len(i.operands) // 2, 1)] if op == "reduce" else i.operands
            return float(sum(_elements(self.operand_type(comp, o)) for o in inputs))
        if op == "reduce-window":
            size = _WINDOW_SIZE.search(i.attrs)
            window = math.prod(int(s) for s in size.group(1).split("x")) if size else 1
            return float(out * window)
        if op == "sort":
            arrays = _arrays(i.type)
            dim = _ints(_DIMS["dimensions"], i.attrs)
            m = arrays[0][1][dim[0]] if arrays and dim and dim[0] < len(arrays[0][1]) else 2
            return float(math.prod(arrays[0][1]) * math.ceil(math.log2(max(m, 2)))) if arrays else 0.0
        if op == "scatter":
            updates = i.operands[len(i.operands) // 2 + 1 :] if len(i.operands) > 2 else ()
            return float(sum(_elements(self.operand_type(comp, u)) for u in updates))
        return float(out)

    # bytes of one counted op of a non-fused computation
    def op_bytes(self, i: _Instr, comp: str) -> float:
        op = i.opcode
        if op in _SLICES:
            return 2.0 * _nbytes(i.type)
        if op in ("copy-start", "slice-start"):
            # asynchronous (XLA:TPU's): the result holds the operand and the destination (a copy's
            # the same size, a slice's second) and a context; it reads and writes the destination's
            arrays = _arrays(i.type)
            if len(arrays) >= 2:
                dtype, dims = arrays[1]
                return 2.0 * math.prod(dims) * _itemsize(dtype)
        if op == "dynamic-update-slice":
            return 2.0 * _nbytes(self.operand_type(comp, i.operands[1])) if len(i.operands) > 1 else 0.0
        reads = [_nbytes(self.operand_type(comp, o)) for o in i.operands]
        written = _nbytes(i.type)
        if op == "fusion":
            for callee in _CALLS.findall(i.attrs)[:1]:
                reads, written = self.fusion_bytes(callee, reads, written)
        return float(sum(reads) + written)

    def fusion_bytes(self, callee: str, reads: list[float], written: float) -> tuple[list[float], float]:
        """A fusion's bytes per operand, and written, where it slices or updates in place."""
        instrs = self.comps.get(callee, [])
        table = self.table.get(callee, {})
        users: dict[str, list[tuple[_Instr, int]]] = {}
        for j in instrs:
            for pos, o in enumerate(j.operands if j.opcode != "parameter" else ()):
                users.setdefault(o, []).append((j, pos))

        def final_users(name: str) -> list[tuple[_Instr, int]]:  # through bitcasts
            out = []
            for j, pos in users.get(name, []):
                out += final_users(j.name) if j.opcode == "bitcast" else [(j, pos)]
            return out

        root = self.root(callee)
        for j in instrs:
            if j.opcode == "parameter" and j.operands and j.operands[0].isdigit():
                k = int(j.operands[0])
                if k >= len(reads):
                    continue
                uses = final_users(j.name)
                if uses and all(u.opcode in _SLICES and pos == 0 for u, pos in uses):
                    reads[k] = sum(_nbytes(u.type) for u, _ in uses)
                elif uses and all(u.opcode == "dynamic-update-slice" and pos == 0 for u, pos in uses):
                    reads[k] = 0.0
        outs = [root]
        if root is not None and root.opcode == "tuple":
            outs = [table.get(o) for o in root.operands]
        updated = 0.0
        for out in outs:
            while out is not None and out.opcode == "bitcast" and out.operands:
                out = table.get(out.operands[0])
            if out is not None and out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
                updated += _nbytes(out.type) - _nbytes(table[out.operands[1]].type)
        return reads, written - updated
