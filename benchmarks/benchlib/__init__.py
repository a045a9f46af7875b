"""The benchmarks' library (not part of the installed vmcgrad): vmcgrad against NetKet and plain JAX,
measured in one run, interleaved.

Each benchmark module here returns rows of measurements; ``benchmarks/bench_*.py`` are the scripts
that run them, and ``python benchmarks/run.py`` (:mod:`benchlib.suite`) runs them all. The scripts'
folder ``benchmarks/`` is on ``sys.path`` when they run, so ``import benchlib`` needs no path edit
(the tests add it with pytest's ``pythonpath``). Times are medians over interleaved repeats (the
candidates take turns, so a noisy machine slows them alike); memory is the compiled program's
``memory_analysis().temp_size_in_bytes``; collectives come from :func:`vmcgrad.collective_report`.
The benchmarks use vmcgrad's public functions only; NetKet is imported inside the functions that
need it.
"""

from ._harness import MEASURED as MEASURED
from ._harness import Candidate as Candidate
from ._harness import Row as Row
from ._harness import check_agree as check_agree
from ._harness import format_table as format_table
from ._harness import measure as measure
from ._harness import use_cpu_devices as use_cpu_devices
from ._io import json_safe as json_safe
from ._io import save_figure as save_figure
from ._io import write_json as write_json
from ._scripts import rows_for_device_counts as rows_for_device_counts
from ._setup import init_model as init_model
from ._setup import log_psi as log_psi
from ._setup import netket_grad as netket_grad
from ._setup import place as place
from ._table import Column as Column
from ._table import table as table
from ._vit import ViT as ViT
