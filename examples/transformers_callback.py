"""A Hugging Face Trainer run launched by the Trainer itself (no `python -m mldebug`): the
callback turns on the NaN/Inf watch and the assertions. A tiny GPT-2 made from a config
(nothing downloaded); at step 2 the custom `compute_loss` divides by zero, and mldebug
stops there, in `compute_loss`, at step 2.

    python examples/transformers_callback.py
"""
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from mldebug.integrations.transformers import MLDebugCallback


class Tokens(Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = model(**inputs)
        weight = 2 - self.state.global_step                       # 0 at step 2
        loss = out.loss / weight * (2 - self.state.global_step)   # the bug: 0 / 0
        return (loss, out) if return_outputs else loss


if __name__ == "__main__":
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                             max_steps=4, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    trainer = MyTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                        callbacks=[MLDebugCallback()])
    trainer.train()
    print("trained", trainer.state.global_step, "steps")
