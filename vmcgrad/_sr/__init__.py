"""Stochastic reconfiguration: the QGT operators (parameter space), the NTK kernel and MinSR
(sample space), their vector views and the conjugate-gradient solver.
"""
