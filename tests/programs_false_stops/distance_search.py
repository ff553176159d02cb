"""k-means: the distance to the nearest centroid starts at +inf (a tensor filled with
inf, and a Python float inf for the best total), and shrinks from there."""
import hashlib

import torch

torch.manual_seed(0)
points = torch.cat([torch.randn(40, 2) + 4, torch.randn(40, 2) - 4, torch.randn(40, 2)])
centroids = points[torch.randperm(len(points))[:3]].clone()
best_total = float("inf")
for step in range(8):
    nearest = torch.full((len(points),), float("inf"))
    assign = torch.zeros(len(points), dtype=torch.long)
    for k, c in enumerate(centroids):
        d = ((points - c) ** 2).sum(1)
        closer = d < nearest
        nearest = torch.where(closer, d, nearest)
        assign[closer] = k
    total = nearest.sum().item()
    best_total = min(best_total, total)
    centroids = torch.stack([points[assign == k].mean(0) for k in range(3)])
    print("inertia", round(total, 4))
print("best", round(best_total, 4))
print("weights", hashlib.sha256(centroids.numpy().tobytes()).hexdigest())
