r"""What a TPU's tiled layouts make of a compiled program's arrays: each array's bytes as laid out.

A TPU stores an array in tiles: a layout ``{3,1,2,0:T(8,128)}`` (minor-to-major dimensions, then the
tile) pads the most minor dimension to a multiple of 128 and the next to a multiple of 8. An array
whose minor dimension is small (a GCNN's 8 features, a batch of 16 samples placed minor by XLA's
layout assignment) takes up to 16 times its nominal bytes, so a batch's memory on a TPU need not grow
with the batch until that dimension reaches 128. This script reads an optimized HLO text (a program
compiled on a TPU: ``compiled.as_text()``, e.g. ``benchmarks/accelerator_cost.py --hlo-dir``) and
prints, for the computation of one ``while`` loop's body (``--loop``) or the entry computation, the
arrays its instructions define (parameters, bitcasts and get-tuple-element left out), largest
first, with their bytes as tiled and as nominal, and the sums: not the program's peak (not every
array is live at once), but where a batch's bytes go.

Usage::

    python benchmarks/tpu_padding.py program.hlo.txt --loop while.12 --top 10
"""

from __future__ import annotations

import argparse
import math
import re

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
ITEMSIZE |= {"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
ARRAY = re.compile(
    r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\{([\d,]*)(?::T\((\d+),(\d+)\))?[^}]*\} ([\w\-]+)\("
)
SKIP = {"parameter", "bitcast", "get-tuple-element", "constant"}


def computation(text: str, loop: str | None) -> str:
    """The text of ``loop``'s body computation, or of the entry computation."""
    if loop is None:
        start = text.index("\nENTRY ")
    else:
        found = re.search(re.escape(loop) + r" = .*?body=%([\w.\-]+)", text)
        if found is None:
            raise SystemExit(f"--loop {loop}: no while instruction of that name in the program")
        start = text.index(f"%{found.group(1)} ")
    return text[start : text.index("\n}\n", start)]


def tiled_bytes(dtype: str, dims: list[int], minor_to_major: list[int], tile) -> int:
    """An array's bytes as laid out: the most minor dimension padded to ``tile[1]``, the next to
    ``tile[0]`` (no tile: nominal)."""
    padded = list(dims)
    if tile and minor_to_major:
        padded[minor_to_major[0]] = -(-dims[minor_to_major[0]] // tile[1]) * tile[1]
        if len(minor_to_major) > 1:
            padded[minor_to_major[1]] = -(-dims[minor_to_major[1]] // tile[0]) * tile[0]
    return math.prod(padded) * ITEMSIZE[dtype]


def arrays(body: str) -> list[tuple]:
    """``(tiled bytes, nominal bytes, name, opcode, dtype, dims, minor_to_major)``, largest first."""
    rows = []
    for line in body.split("\n"):
        m = ARRAY.match(line)
        if not m or m.group(2) not in ITEMSIZE or m.group(7) in SKIP:
            continue
        name, dtype, dims, order, t0, t1, op = m.groups()
        dims = [int(d) for d in dims.split(",") if d]
        order = [int(d) for d in order.split(",") if d]
        tile = (int(t0), int(t1)) if t0 else None
        nominal = math.prod(dims) * ITEMSIZE[dtype]
        rows.append((tiled_bytes(dtype, dims, order, tile), nominal, name, op, dtype, dims, order))
    return sorted(rows, reverse=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", help="an optimized HLO text file (compiled.as_text())")
    ap.add_argument("--loop", help="a while instruction's name (e.g. while.12): its body; default the entry")
    ap.add_argument("--top", type=int, default=10, help="how many of the largest arrays to print")
    args = ap.parse_args(argv)
    with open(args.hlo) as f:
        rows = arrays(computation(f.read(), args.loop))
    mib = 2**20
    tiled, nominal = sum(r[0] for r in rows) / mib, sum(r[1] for r in rows) / mib
    print(f"{args.loop or 'entry'}: {len(rows)} arrays, {tiled:.1f} MiB tiled, {nominal:.1f} MiB nominal")
    for t, n, name, op, dtype, dims, order in rows[: args.top]:
        shape = f"{dtype}[{','.join(map(str, dims))}]{{{','.join(map(str, order))}}}"
        print(f"  {t / mib:9.2f} MiB tiled  {n / mib:8.2f} nominal  {op:12s} {shape}  {name}")


if __name__ == "__main__":
    main()
