"""Chunks -> runner -> one reduction: the chunked map-reduce primitive, its transformation rules,
and the one per-device runner whose result is reduced once.
"""
