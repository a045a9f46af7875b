"""Checks read from programs: row coupling and holomorphy from the user's jaxpr, and the
collectives of compiled HLO.
"""
