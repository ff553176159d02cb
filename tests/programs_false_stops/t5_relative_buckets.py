"""T5 (transformers, from a config): its relative-position buckets take the log of a
distance of 0, -inf, and cast it to an integer under a `torch.where` that never picks it.
Trained a few steps, then generating (greedy, with its cache)."""
import hashlib

import torch
import transformers

torch.manual_seed(0)
transformers.set_seed(0)
config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                               num_heads=4, decoder_start_token_id=0, pad_token_id=0)
model = transformers.T5ForConditionalGeneration(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(1, 100, (4, 12))
mask = torch.ones(4, 12, dtype=torch.long)
mask[1, 8:] = 0
for step in range(3):
    out = model(input_ids=ids, attention_mask=mask, labels=ids[:, :6].contiguous())
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    print("step", step, round(out.loss.item(), 6))
model.eval()
print("generated", model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4).tolist())
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
