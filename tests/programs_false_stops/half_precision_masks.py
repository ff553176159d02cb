"""Masks written in float32 far below what float16 holds, cast to float16: Hugging Face's
Funnel subtracts 1e6 at padding and takes `softmax(..., dtype=float16)`; LongT5's
transient-global attention writes -1e10 and casts the bias with `.type(scores.dtype)`.
The cast makes -inf, the same masked entry. Both models run in float16 on a padded
batch, for evaluation."""
import hashlib
import logging

import torch
import transformers
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)
torch.manual_seed(0)
ids = torch.randint(3, 64, (2, 8))
attention_mask = torch.ones(2, 8, dtype=torch.long)
attention_mask[1, 5:] = 0
funnel = transformers.FunnelForMaskedLM._from_config(
    transformers.FunnelConfig(vocab_size=64, d_model=32, n_head=4, d_head=8, d_inner=64,
                              block_sizes=[1, 1], pad_token_id=0),
    dtype=torch.float16).eval()
longt5 = transformers.LongT5ForConditionalGeneration._from_config(
    transformers.LongT5Config(vocab_size=64, pad_token_id=0, eos_token_id=2,
                              decoder_start_token_id=0, d_model=32, d_kv=8, d_ff=64,
                              num_layers=1, num_heads=4, relative_attention_num_buckets=8,
                              relative_attention_max_distance=16, local_radius=2,
                              global_block_size=4, encoder_attention_type="transient-global"),
    attn_implementation="eager", dtype=torch.float16).eval()
with torch.no_grad():
    for step in range(2):
        logits = funnel(input_ids=ids, attention_mask=attention_mask).logits
        print("funnel", step, bool(torch.isfinite(logits).all()), logits.float().sum().item())
        logits = longt5(input_ids=ids, attention_mask=attention_mask,
                        decoder_input_ids=torch.zeros(2, 1, dtype=torch.long)).logits
        print("longt5", step, bool(torch.isfinite(logits).all()), logits.float().sum().item())
data = b"".join(p.detach().numpy().tobytes() for m in (funnel, longt5) for p in m.parameters())
print("weights", hashlib.sha256(data).hexdigest())
