"""Planted bug: a token-embedding matrix imported from numpy with a NaN row.

A tiny GPT-2 (transformers GPT2Config: 2 layers, 64 wide, 4 heads, vocab 100, random
weights, nothing downloaded) gets its token embeddings from a numpy array (as from an
exported checkpoint) whose row 7 is NaN. No torch op made the NaN; the first watched op
that reads it is the embedding lookup in module 'transformer.wte' during the forward
call at `# here`: created=False, it came in through input 0 (weight).
"""
import numpy as np
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
model.eval()

table = np.random.default_rng(0).normal(0, 0.02, (100, 64)).astype(np.float32)
table[7] = np.nan                                         # the corrupt row
model.transformer.wte.weight = nn.Parameter(torch.from_numpy(table))

ids = torch.tensor([[1, 2, 7, 3, 4, 5]])
with torch.no_grad():
    logits = model(ids).logits  # here
print("nan logits:", bool(logits.isnan().any()))
