# Run from the repository root: the hooks of write_layers.py (the first, layer-by-layer writer) against transformers' hidden states, on a tiny model.
import sys

import torch

sys.path.insert(0, "tests")
from tiny import tiny_chat_tokenizer, tiny_model

sys.path.insert(0, "benchmarks/2026-12-05-head-training-bf16-xeon/layer-features-probe")
import write_layers

write_layers.LAYERS = (1, 2, 3)  # the tiny model's layers
import viasd.training.conversations as conv
from viasd.training.prompts import Opener

conv._step = write_layers.step
tok = tiny_chat_tokenizer(320)
target = tiny_model("qwen2", vocab_size=320, hidden=64, init_scale=0.3)
print(target.config.num_hidden_layers)
w = next(
    conv.write_conversations(
        target, tok, None, lambda i: Opener("hello", False), 0, rows=4, max_request=6, max_answer=12
    )
)
with torch.inference_mode():
    out = target(input_ids=torch.tensor([w.tokens]), output_hidden_states=True)
H = 64
for row, p in enumerate(w.positions):
    f = w.features[row].float()
    for k, L in enumerate((1, 2, 3)):
        torch.testing.assert_close(
            f[H * (k + 1) : H * (k + 2)], out.hidden_states[L][0, p].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2
        )
    torch.testing.assert_close(f[:H], out.hidden_states[-1][0, p].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
print("ok", w.features.shape, len(w.positions))
