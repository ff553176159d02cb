"""A policy over actions, the illegal ones masked with -inf logits: sampled from a
Categorical, trained with REINFORCE and an entropy bonus; the KL between the policy
before and after each update is logged under no_grad (torch.distributions subtracts the
masked -inf log-probabilities, a NaN it overwrites itself)."""
import hashlib

import torch
from torch import nn
from torch.distributions import Categorical, kl_divergence

torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 5))
opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
for episode in range(8):
    state = torch.randn(16, 6)
    legal = torch.rand(16, 5) < 0.6
    legal[:, 0] = True                                  # one legal action at least
    logits = policy(state).masked_fill(~legal, float("-inf"))
    dist = Categorical(logits=logits)
    action = dist.sample()
    reward = (action == 0).float() - 0.1 * action.float()
    loss = -(dist.log_prob(action) * reward).mean() - 0.01 * dist.entropy().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = Categorical(logits=policy(state).masked_fill(~legal, float("-inf")))
        kl = kl_divergence(Categorical(logits=logits.detach()), after).mean()
    print("reward", round(reward.mean().item(), 4), "kl", round(kl.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in policy.parameters())
print("weights", hashlib.sha256(data).hexdigest())
