"""``vmcgrad.VmcgradWarning``: the category of every warning vmcgrad itself issues.

One category lets a user silence or escalate vmcgrad's notices without touching JAX's or NetKet's
(``warnings.filterwarnings("ignore", category=vmcgrad.VmcgradWarning)``), and lets the test suite turn
every vmcgrad warning that no test asserts into an error (``pyproject.toml``'s ``filterwarnings``).
"""


class VmcgradWarning(UserWarning):
    """A notice from vmcgrad: the call runs, but not as the user may have meant (see the message's fix)."""


class ChunkRetryWarning(VmcgradWarning, RuntimeWarning):
    """``chunk_size="auto"`` ran out of memory at its chunk and retried once at half of it."""
