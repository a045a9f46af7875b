"""Reading compiled programs (optimized HLO): which collectives run and where
(:mod:`~vmcgrad._hlo.collectives`), and what a program costs on an accelerator, its operations in
sequence, FLOPs and bytes, each weighted by how often it runs (:mod:`~vmcgrad._hlo.ops`,
:mod:`~vmcgrad._hlo.cost`). The bottom of the package: nothing of vmcgrad above is imported, so the
chunk and design choices of every layer can price their candidates with it.
"""
