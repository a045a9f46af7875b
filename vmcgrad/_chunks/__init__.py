"""Problem -> chunks: how one device walks its samples in chunks with row weights, and the chunk
size a memory budget allows (compiled programs measured against the budget).
"""
