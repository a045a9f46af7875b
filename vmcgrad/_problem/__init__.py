"""Samples -> problem: the user's function as a jit argument, eager validation, the problem every
estimator solves, and how samples are laid out over devices (sharding, multi-process start).
"""
