"""Speech-style CTC training with `CTCLoss(zero_infinity=True)`: one sample's labels are
longer than its frames, an alignment that cannot be made (its loss is +inf, zeroed by
torch as asked, with its gradient); torch's log_alpha workspace is partly uninitialized
memory."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
rnn, out = nn.GRU(4, 16), nn.Linear(16, 6)
params = list(rnn.parameters()) + list(out.parameters())
opt = torch.optim.Adam(params, lr=1e-2)
ctc = nn.CTCLoss(blank=0, zero_infinity=True)
x = torch.randn(10, 3, 4)                                  # 10 frames, 3 samples
targets = torch.randint(1, 6, (3, 12))
target_lengths = torch.tensor([4, 12, 5])                  # sample 1: 12 labels > 10 frames
input_lengths = torch.tensor([10, 10, 10])
for step in range(3):
    log_probs = out(rnn(x)[0]).log_softmax(-1)
    loss = ctc(log_probs, targets, input_lengths, target_lengths)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", step, round(loss.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in params)
print("weights", hashlib.sha256(data).hexdigest())
