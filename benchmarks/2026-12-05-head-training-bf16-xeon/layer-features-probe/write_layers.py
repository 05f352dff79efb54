"""Probe: the target writes head data as `viasd train-drafter` does, but each feature row also holds the residual
stream entering three of its layers (EAGLE-3's low, middle and high features): [final | layer L0 | L1 | L2].
The layers run one by one (the fused stack has no hooks); the conversations are the same as the real writer's."""

import sys
import time
from pathlib import Path

import torch

import viasd.training.conversations as conversations
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment, Stack, ragged_pass
from viasd.passes.route import attention_kernel
from viasd.training.dataset import DataFolder
from viasd.training.writing import write_data
from viasd.views.recipe import QuantRecipe
from viasd.views.view import applied

LAYERS = (2, 14, 25)  # inputs of these = outputs of layers 1, 13, 24 of 28 (SpecForge's choice for 28 layers)


def step(model, view, parts):
    segments = [Segment(c.cache, torch.tensor(ids), 1) for c, ids in parts]
    ends = torch.tensor([len(ids) for _, ids in parts]).cumsum(0) - 1
    seen_layers = {index: [] for index in LAYERS}
    hooks = [
        model.model.layers[index].input_layernorm.register_forward_pre_hook(
            lambda m, args, index=index: seen_layers[index].append(args[0].reshape(-1, args[0].shape[-1])[ends])
        )
        for index in LAYERS
    ]
    try:
        with torch.inference_mode(), applied(model, view), head_inputs(model) as seen:
            out = ragged_pass(model, segments, Stack.LOOP, attention_kernel(model))
    finally:
        for hook in hooks:
            hook.remove()
    features = torch.cat([seen[-1].float()] + [seen_layers[index][-1].float() for index in LAYERS], dim=-1)
    return torch.stack([rows[-1].float() for rows in out]), features


if __name__ == "__main__":
    out, tokens = Path(sys.argv[1]), int(sys.argv[2])
    conversations._step = step
    engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
    loaded = engine.target
    view = engine.quantized(loaded, QuantRecipe.parse("gguf"))
    folder = DataFolder(out, {"view": "gguf", "seed": 0, "max_request": 64, "max_answer": 256, "layers": list(LAYERS)})
    began = time.monotonic()
    held = write_data(loaded.model, loaded.tokenizer, view, folder, 10**6, tokens, 32, 0, 64, 256, progress=True)
    print(f"{held} tokens in {time.monotonic() - began:.0f} s", flush=True)
