"""nanoGPT's attention without flash attention: the causal mask is written with
masked_fill(-inf); its generate() keeps the top-k logits by setting the rest to -inf."""
import hashlib
import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPT(nn.Module):
    def __init__(self, vocab=32, n_embd=32, block_size=16):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.attn = CausalSelfAttention(n_embd, 4, block_size)
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        x = x + self.attn(self.ln(x))
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


torch.manual_seed(0)
model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 32, (8, 17))
for step in range(5):
    _, loss = model(data[:, :-1], data[:, 1:].contiguous())
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", round(loss.item(), 6))
print("sample", model.generate(data[:2, :4], 8, top_k=5).tolist())
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(weights).hexdigest())
