"""The one place vmcgrad touches JAX's private modules (``jax._src``), each feature-detected.

Every function here imports what it needs when called and fails with vmcgrad's name and the JAX
version if the private API has moved, instead of an ``ImportError`` deep inside a user's step.
"""

from __future__ import annotations

from typing import Any

import jax


class PrivateJaxAPIError(RuntimeError):
    """A private JAX API vmcgrad relies on is missing in this JAX version."""


def _missing(what: str, err: Exception | None = None) -> PrivateJaxAPIError:
    return PrivateJaxAPIError(
        f"vmcgrad: the private JAX API {what} is not available in jax {jax.__version__} "
        f"(vmcgrad was written against jax 0.10.2){f': {err}' if err else ''}. "
        "Fix: install jax==0.10.2, or report this to vmcgrad."
    )


def gloo_tcp_collectives_module() -> Any:
    """The module holding ``make_gloo_tcp_collectives`` (``jax._src.xla_bridge._jax``)."""
    try:
        from jax._src import xla_bridge
    except ImportError as err:
        raise _missing("jax._src.xla_bridge", err) from None
    module = getattr(xla_bridge, "_jax", None)
    if module is None or getattr(module, "make_gloo_tcp_collectives", None) is None:
        raise _missing("jax._src.xla_bridge._jax.make_gloo_tcp_collectives")
    return module


def cluster_env() -> Any:
    """JAX's ``ClusterEnv`` (``jax._src.clusters``): the launcher environments that
    ``jax.distributed.initialize()`` detects, in ``ClusterEnv._cluster_types``, and its detection,
    ``ClusterEnv.auto_detect_unset_distributed_params``."""
    try:
        from jax._src import clusters
    except ImportError as err:
        raise _missing("jax._src.clusters", err) from None
    env = getattr(clusters, "ClusterEnv", None)
    if not all(hasattr(env, a) for a in ("_cluster_types", "auto_detect_unset_distributed_params")):
        raise _missing("jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params")
    return env
