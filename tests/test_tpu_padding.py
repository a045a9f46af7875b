"""``benchmarks/tpu_padding.py``: an array's bytes as a TPU's tiled layout holds them, read from HLO."""

import pytest
import tpu_padding  # benchmarks/ is on sys.path (pyproject.toml's pythonpath)

#: a TPU-compiled program's shape: a loop whose body makes a batch of 16 with the batch minor (dim 0
#: padded 16 -> 128, dim 1 is 8: a multiple of the tile's 8), an untiled scalar and a padded pair
HLO = """\
HloModule m

%body (p: (s32[], f32[16,8])) -> (s32[], f32[16,8]) {
  %p = (s32[]{:T(128)}, f32[16,8]{0,1:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = f32[16,8]{0,1:T(8,128)} get-tuple-element(%p), index=1
  %y = f32[16,8]{0,1:T(8,128)} fusion(%x), kind=kLoop, calls=%f
  %z = f32[3,5]{1,0:T(8,128)} fusion(%x), kind=kLoop, calls=%g
  %w = f32[2,256]{1,0} fusion(%x), kind=kLoop, calls=%h
  ROOT %t = (s32[]{:T(128)}, f32[16,8]{0,1:T(8,128)}) tuple(%i, %y)
}

%cond (q: (s32[], f32[16,8])) -> pred[] {
  %q = (s32[]{:T(128)}, f32[16,8]{0,1:T(8,128)}) parameter(0)
  ROOT %c = pred[]{:T(128)} constant(true)
}

ENTRY %main (a: f32[16,8]) -> f32[16,8] {
  %a = f32[16,8]{0,1:T(8,128)} parameter(0)
  %loop = (s32[]{:T(128)}, f32[16,8]{0,1:T(8,128)}) while(%tuple.1), condition=%cond, body=%body
  ROOT %r = f32[16,8]{0,1:T(8,128)} get-tuple-element(%loop), index=1
}
"""


def test_tiled_bytes_pad_the_two_minor_dimensions_to_the_tile():
    # minor-to-major {0,1}: dim 0 (16) is minor, padded to 128; dim 1 (8) to a multiple of 8
    assert tpu_padding.tiled_bytes("f32", [16, 8], [0, 1], (8, 128)) == 128 * 8 * 4
    # {1,0}: dim 1 (5) padded to 128, dim 0 (3) to 8
    assert tpu_padding.tiled_bytes("f32", [3, 5], [1, 0], (8, 128)) == 8 * 128 * 4
    assert tpu_padding.tiled_bytes("f32", [2, 256], [1, 0], None) == 2 * 256 * 4  # no tile: nominal


def test_arrays_of_a_loop_body_largest_first_without_parameters_or_tuple_reads():
    rows = tpu_padding.arrays(tpu_padding.computation(HLO, "loop"))
    assert [(r[2], r[0], r[1]) for r in rows] == [
        ("y", 4096, 512),
        ("z", 4096, 60),
        ("w", 2048, 2048),
    ]
    entry = tpu_padding.arrays(tpu_padding.computation(HLO, None))
    assert entry == []  # the entry defines only a parameter, the loop's tuple and a read of it


def test_an_unknown_loop_is_refused_by_name(tmp_path):
    path = tmp_path / "m.hlo.txt"
    path.write_text(HLO)
    with pytest.raises(SystemExit, match=r"--loop while\.9: no while instruction"):
        tpu_padding.main([str(path), "--loop", "while.9"])
