"""Generation that bans words (transformers' `bad_words_ids`: a bias of -inf built with
`torch.tensor` from a Python list and written into the logits) with beam search, then
sampling with a `sequence_bias`, on a Llama built from a config."""
import hashlib

import torch
import transformers

torch.manual_seed(0)
transformers.set_seed(0)
config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=64, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = transformers.LlamaForCausalLM(config).eval()
ids = torch.randint(3, 100, (2, 8))
ids[1, :3] = 0
mask = (ids != 0).long()
with torch.no_grad():
    beams = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                           max_new_tokens=8, num_beams=3, bad_words_ids=[[5], [6, 7]])
    print("beams", beams.tolist())
    torch.manual_seed(1)
    sampled = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                             max_new_tokens=8, do_sample=True, top_k=20,
                             sequence_bias={(9,): float("-inf"), (11, 12): -5.0})
    print("sampled", sampled.tolist())
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
