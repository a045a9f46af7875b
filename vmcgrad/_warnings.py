"""``vmcgrad.VmcgradWarning``: the category of every warning vmcgrad itself issues.

One category lets a user silence or escalate vmcgrad's notices without touching JAX's or NetKet's
(``warnings.filterwarnings("ignore", category=vmcgrad.VmcgradWarning)``), and lets the test suite turn
every vmcgrad warning that no test asserts into an error (``pyproject.toml``'s ``filterwarnings``).
"""

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def stacklevel_outside_package() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside vmcgrad."""
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


class VmcgradWarning(UserWarning):
    """A notice from vmcgrad: the call runs, but not as the user may have meant (see the message's fix)."""


class ChunkRetryWarning(VmcgradWarning, RuntimeWarning):
    """``chunk_size="auto"`` ran out of memory at its chunk and retried once at half of it."""


class UnknownPrimitiveWarning(VmcgradWarning):
    """The row-coupling check met a JAX primitive it has no rule for and could not check ``fun``
    numerically (traced inputs): vmcgrad assumed each row depends on its own sample only."""
