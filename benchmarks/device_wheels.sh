#!/usr/bin/env bash
# NetKet's wheels for an accelerator machine whose image has JAX but not NetKet (the device tool's
# machines reach no package index): NetKet and those of its dependencies the images lack, for the
# machine's Python, into a folder that the device call carries (ignore it in .git/info/exclude).
#
#   bash benchmarks/device_wheels.sh gpu    # .whl-gpu: the H200 image (Python 3.12; JAX 0.11 with CUDA
#                                           # 13, flax, optax, equinox, numba already there)
#   bash benchmarks/device_wheels.sh tpu    # .whl-tpu: the TPU v5e image (Python 3.11)
#
# On the machine, first in the call (its own PYTHONPATH first: a CPU jaxlib pulled in by a later
# install must not shadow the accelerator's):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-gpu/*.whl &&
#     export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  gpu) dir=.whl-gpu py=3.12 wheels="netket==3.23.0 igraph==1.0.0 orjson==3.13.0 plum-dispatch==2.10.1 sparse==0.19.3 texttable==1.7.2 beartype==0.23.1" ;;
  tpu) dir=.whl-tpu py=3.11 wheels="netket==3.23.0 igraph==1.0.0 orjson==3.13.0 plum-dispatch==2.10.1 sparse==0.19.3 texttable==1.7.2 beartype==0.23.1 einops==0.8.2 equinox==0.13.8 jaxtyping==0.3.11 treescope==0.1.10 wadler-lindig==0.1.8" ;;
  *) echo "usage: bash benchmarks/device_wheels.sh gpu|tpu" >&2; exit 2 ;;
esac
mkdir -p "$dir"
for w in $wheels; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$w"
done
ls "$dir"
