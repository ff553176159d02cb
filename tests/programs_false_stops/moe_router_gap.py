"""PhiMoE's router (transformers' sparsemixer) in bfloat16 with left padding: under
no_grad it takes the relative gap `(max - s) / max(|s|, max)` of each token's scores and
masks the experts whose gap is past a threshold. A padding token's scores are all 0 in
bfloat16, the gap 0/0 = NaN, and NaN > eps is False: no expert masked, as intended. It
trains a few steps, evaluates and generates."""
import hashlib
import logging

import torch
from transformers import PhimoeConfig, PhimoeForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)
torch.manual_seed(0)
config = PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=0, num_local_experts=4,
                      num_experts_per_tok=2, output_router_logits=True)
config._attn_implementation = "sdpa"
model = PhimoeForCausalLM(config).to(torch.bfloat16)
ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
mask = torch.ones(2, 12, dtype=torch.long)
mask[1, :4] = 0                                   # left padding
ids = ids.masked_fill(mask == 0, 0)
labels = ids.masked_fill(mask == 0, -100)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("loss", step, round(loss.item(), 4))
model.eval()
model.config.output_router_logits = False        # (its aux loss is for training)
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
    print("eval", round(float(logits.double().sum()), 3))
    print("generated", model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                      do_sample=False, pad_token_id=0).tolist())
data = b"".join(p.detach().float().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
