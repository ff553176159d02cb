"""Hugging Face's Wav2Vec2-Conformer fine-tuned with CTC, a padded sample in the batch:
`torch._ctc_loss` returns, beside the loss, a workspace for its backward (log_alpha) that
holds -inf for unreachable alignments and memory it never wrote; only the loss is a
value. Trains a few steps, then a second model is built and trained the same way."""
import hashlib
import logging

import torch
import transformers
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)
wav = torch.randn(2, 1600, generator=torch.Generator().manual_seed(5))
attention_mask = torch.ones(2, 1600, dtype=torch.long)
attention_mask[1, 1000:] = 0
wav[1, 1000:] = 0
labels = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, -100, -100]])
cfg = transformers.Wav2Vec2ConformerConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=4, vocab_size=16, pad_token_id=0, mask_time_prob=0.0,
    conv_depthwise_kernel_size=3, ctc_loss_reduction="mean")
digest = hashlib.sha256()
for run in range(2):
    torch.manual_seed(run)
    model = transformers.Wav2Vec2ConformerForCTC(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = model(input_values=wav, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", run, step, round(loss.item(), 6))
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
print("weights", digest.hexdigest())
