"""transformers' generate from a tiny GPT-2 made from a config (nothing downloaded):
sampling with top_k / top_p and a repetition penalty (the filtered logits are set to
-inf), typical sampling (its entropy multiplies the filtered logits' -inf
log-probabilities by their probability 0 and sums with `nansum`), then beam search (its
beams start from -inf scores)."""
import hashlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                    bos_token_id=0, eos_token_id=1, pad_token_id=1)
model = GPT2LMHeadModel(config).eval()
prompt = torch.randint(2, 64, (2, 5))
sampled = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                         top_k=8, top_p=0.9, repetition_penalty=1.3, max_new_tokens=10)
print("sampled", sampled.tolist())
typical = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                         top_k=8, typical_p=0.9, max_new_tokens=10)
print("typical", typical.tolist())
beams = model.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=3,
                       do_sample=False, max_new_tokens=8, early_stopping=True)
print("beams", beams.tolist())
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
