"""Cause: the gradient of eigh's eigenvectors at repeated eigenvalues. Its backward
divides by the gaps between eigenvalues, and a matrix with two equal eigenvalues has a
gap of 0: Inf/NaN in backward (stage backward, the marked line).
Remedy: separate the eigenvalues (a tiny diagonal jitter). `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
w = torch.ones(4, requires_grad=True)
a = torch.diag(w * torch.tensor([1.0, 2.0, 2.0, 3.0]))   # eigenvalue 2 twice
if FIXED:
    a = a + torch.diag(torch.arange(4.0)) * 1e-3
values, vectors = torch.linalg.eigh(a)  # here
loss = (vectors[:, -1] * torch.arange(4.0)).sum() + values.sum()
loss.backward()
print("grad", w.grad.tolist())
