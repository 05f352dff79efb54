"""The chain head trained from scratch on the same data for the same steps, aiming at the written tokens or at the
target's own distribution (`TrainSettings.labels`); prints what each measures on the held-out conversations.

    python ab_labels.py {tokens|distribution} STEPS OUT.safetensors [SEED]

Reads the data `viasd train-drafter` wrote for the default target (viasd's cache). Bounded in steps, not seconds, so
an arm learns the same whatever else shares the CPU; what a step costs is timed apart, on a quiet machine, by
`python scripts/head_train_step_costs.py --labels ...`.
"""

import json
import sys
import time
from pathlib import Path

import torch

from viasd.cache import cache_folder
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.heads.file import save_head
from viasd.models.catalog import DEFAULT_TARGET
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import vocabulary_fingerprint
from viasd.training.dataset import DataFolder
from viasd.training.train import Checkpoint, TrainSettings, train

labels, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
loaded = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET)).target
model, tok = loaded.model, loaded.tokenizer
fingerprint = model_fingerprint(model)
path = cache_folder("heads") / fingerprint / "data"
data = DataFolder(path, json.loads((path / "settings.json").read_text())).load()
stops = {int(t) for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
settings = TrainSettings(seconds=1e9, steps=steps, labels=labels, seed=seed)
began = time.monotonic()
head, measured = train(
    data,
    model.get_input_embeddings().weight.detach(),
    model.get_output_embeddings().weight.detach(),
    settings,
    Checkpoint(out.with_suffix(".pt")),
    stops,
    progress=False,
)
print(labels, seed, json.dumps(measured), f"wall {time.monotonic() - began:.0f} s", flush=True)
save_head(out, head.to(torch.bfloat16), fingerprint, vocabulary_fingerprint(tok), {**settings.to_dict(), **measured})
