"""The estimators built on the runner: ``batched_vjp``, ``batched_jvp``, ``expect_grad``, what
``chunk_size="auto"`` picks for each, and ``lower``.
"""
