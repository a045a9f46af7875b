"""Chunks -> runner -> one reduction: the chunked map-reduce primitive (:mod:`.primitive`), one chunk's
body (:mod:`.body`), the transformation rules (:mod:`.rules`, registered on import here), the
``with_refs`` pullback path (:mod:`.refs`) and the one per-device runner whose result is reduced once
(:mod:`.runner`).
"""

from vmcgrad._runner import rules as rules  # registers the primitive's jvp, transpose, batching rules
