"""Scratch: the chain head trained from scratch on the same data for the same wall time, float32 vs bf16 products."""

import json
import sys
import time
from pathlib import Path

import torch

from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.heads.file import save_head
from viasd.models.catalog import DEFAULT_TARGET
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import vocabulary_fingerprint
from viasd.training.dataset import DataFolder
from viasd.training.train import Checkpoint, TrainSettings, train

dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[sys.argv[1]]
steps = int(sys.argv[2])
out = Path(sys.argv[3])
loaded = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET)).target
model, tok = loaded.model, loaded.tokenizer
home = next(Path.home().joinpath(".cache/viasd/heads").iterdir())
path = home / "data"
folder = DataFolder(path, json.loads((path / "settings.json").read_text()))
data = folder.load()
stops = {int(t) for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
settings = TrainSettings(seconds=1e9, steps=steps)
t = time.monotonic()
head, measured = train(
    data,
    model.get_input_embeddings().weight.detach(),
    model.get_output_embeddings().weight.detach(),
    settings,
    Checkpoint(out.with_suffix(".pt")),
    stops,
    progress=False,
    dtype=dtype,
)
print(sys.argv[1], json.dumps(measured), f"wall {time.monotonic() - t:.0f} s", flush=True)
fp = model_fingerprint(model)
save_head(out, head.to(torch.bfloat16), fp, vocabulary_fingerprint(tok), {**settings.to_dict(), **measured})
