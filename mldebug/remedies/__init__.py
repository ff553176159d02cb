"""What a stop most likely comes from, and how people usually fix it.

The watch decides that a value is a stop and where it was made; this package turns the
stop into a cause in one plain sentence and a remedy with the line to change:
`hints.py` is the catalogue of causes (named rules, first match wins), `evidence.py`
reads, once and only at a stop, what those rules need from the op's live inputs and the
optimizer. Nothing here runs on a healthy step. The watch calls `hints.gather` when it has
decided to stop and `hints.explain` when the stop is reported; the step history offers
its norms through `hints.provide`.
"""
