"""Checks read from the user's function: row coupling, holomorphy and the tangent map of its jaxpr.
(The readers of compiled HLO are :mod:`vmcgrad._hlo`.)
"""
