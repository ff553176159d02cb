# An uncaught exception: under debugpy it is debugpy's to report, not a pdb post-mortem.
def fail(n):
    raise ValueError(f"bad value {n}")  # here


fail(3)
