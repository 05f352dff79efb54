"""Probe: the chain head from the final feature alone (as shipped) against the chain head whose first state also
folds in three layers' features (EAGLE-3's fusion): s_0 = h + W [norm(l0); norm(l1); norm(l2)], W zero at the
start, so it begins as the chain head. Same data, same steps, same seed, bf16 products; held-out measures.
Variants: plain, fused, and the plain head with more capacity (blocks2: two residual blocks; width2048).
    python train_fused.py DATA VARIANT STEPS [SEED]"""

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

import viasd.training.train as T
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.heads.network import DraftHead, HeadConfig, _Norm
from viasd.models.catalog import DEFAULT_TARGET
from viasd.training.dataset import DataFolder

path, variant, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # the head's initial weights and its batches
H = 1536


class FusedHead(DraftHead):
    def __init__(self, config, token_ids, layers=3):
        super().__init__(config, token_ids)
        self.norms = nn.ModuleList(_Norm(config.hidden) for _ in range(layers))
        self.fuse = nn.Linear(layers * config.hidden, config.hidden, bias=False)
        nn.init.zeros_(self.fuse.weight)

    def start(self, f):
        parts = [norm(f[:, H * (k + 1) : H * (k + 2)]) for k, norm in enumerate(self.norms)]
        return f[:, :H] + self.fuse(torch.cat(parts, -1))


def unroll(head, target, data, ex, batch, depth):
    at = data.feature_at[batch]
    end = ex.end_of[at]
    f = data.features[batch].float()
    state = head.start(f) if isinstance(head, FusedHead) else f[:, :H]
    logits, labels, regression = [], [], state.new_zeros(())
    last = len(data.tokens) - 1
    for d in range(1, depth + 1):
        position = at + d
        inside = position + 1 < end
        token_in = data.tokens[position.clamp(max=last)]
        state = head.step(state, target.embeddings[token_in].float())
        logits.append(state @ target.rows.T)
        label = ex.label_of[data.tokens[(position + 1).clamp(max=last)]]
        labels.append(torch.where(inside, label, -1))
        row = ex.row_of[position.clamp(max=last)]
        has = inside & (row >= 0)
        if bool(has.any()):
            wanted = data.features[row[has]][:, :H].float()
            regression = regression + functional.smooth_l1_loss(state[has], wanted) * 0.8 ** (d - 1)
    return torch.stack(logits), torch.stack(labels), regression


T.unroll = unroll
torch.manual_seed(seed)
model = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET)).target.model
data = DataFolder(path, json.loads((path / "settings.json").read_text())).load()
settings = T.TrainSettings()
token_ids = T.head_vocabulary(data, settings.vocab, {151643, 151645})
target = T.Target(
    model.get_input_embeddings().weight.detach(),
    model.get_output_embeddings().weight.detach()[token_ids].float().contiguous(),
)
held_out = max(1, data.conversations // 20)
split = int(data.starts[data.conversations - held_out])
rows = torch.arange(len(data.feature_at))
trained = data.feature_at < split
objective = T.PositionObjective(data, target, token_ids, settings, rows[trained], rows[~trained], T.products_dtype())
# capacity variants of the plain chain head: two residual blocks, or one twice as wide
width, blocks = {"blocks2": (settings.width, 2), "width2048": (2048, 1)}.get(variant, (settings.width, settings.blocks))
cls = FusedHead if variant == "fused" else DraftHead
head = cls(HeadConfig(H, width, blocks, len(token_ids)), token_ids)
optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0, fused=True)
began = time.monotonic()
for step in range(steps):
    for group in optimizer.param_groups:
        group["lr"] = settings.lr * min(1.0, (step + 1) / 100) * (1.0 - 0.9 * step / steps)
    loss = objective.loss(head)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    if step % 500 == 0:
        print(f"{variant} step {step} loss {float(loss.detach()):.3f} {time.monotonic() - began:.0f} s", flush=True)
measured = objective.evaluate(head)
print(variant, steps, f"seed {seed}", json.dumps(measured), f"{time.monotonic() - began:.0f} s", flush=True)
