"""Two additive masks at torch.finfo(dtype).min summed: their sum overflows to -inf, the
same masked entry as either. Hugging Face's GPT-Neo writes its causal mask with
`where(causal, w, finfo.min)` and then adds the attention mask (finfo.min at padding);
a hand-written attention adds a finfo.min causal mask to a finfo.min padding mask. Both
train a few steps with padded samples, and GPT-Neo generates."""
import hashlib
import logging

import torch
from torch import nn
from transformers import GPTNeoConfig, GPTNeoForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)
MIN = torch.finfo(torch.float32).min


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        causal = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), MIN)
        padding = (1.0 - keep[:, None, :].float()) * MIN
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5 + causal + padding
        return self.out(scores.softmax(-1) @ v)


torch.manual_seed(0)
attention = Attention(16)
cfg = GPTNeoConfig(vocab_size=64, max_position_embeddings=32, hidden_size=32, num_layers=2,
                   attention_types=[[["global", "local"], 1]], num_heads=2, window_size=8,
                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
gpt = GPTNeoForCausalLM(cfg)
models = (attention, gpt)
opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-2)
x = torch.randn(3, 6, 16)
keep = torch.arange(6)[None, :] < torch.tensor([6, 4, 2])[:, None]
ids = torch.randint(1, 64, (2, 12))
mask = torch.ones(2, 12, dtype=torch.long)
mask[1, :4] = 0                                          # left padding
labels = ids.masked_fill(mask == 0, -100)
for step in range(4):
    out = attention(x, keep)
    loss = ((out - 1) ** 2).mean(-1)[keep].mean() + gpt(input_ids=ids, attention_mask=mask,
                                                        labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", round(loss.item(), 6))
gpt.eval()
with torch.no_grad():
    made = gpt.generate(ids[:, :6], attention_mask=mask[:, :6], max_new_tokens=4,
                        do_sample=False)
print("generated", made.tolist())
data = b"".join(p.detach().numpy().tobytes() for m in models for p in m.parameters())
print("weights", hashlib.sha256(data).hexdigest())
