"""A model's fingerprint: which weights a profile or a cached quantization was made for."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn


def model_fingerprint(model: nn.Module) -> str:
    """A stable short hash of a model's architecture and weights (config + strided weight samples)."""
    config = model.config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "architectures",
        "quantization_config",
        "_attn_implementation_autoset",
        "use_cache",
    ):
        config.pop(volatile, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        # Sample in fp32 so the fingerprint does not depend on the dtype the model was loaded in.
        sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
        digest.update(name.encode())
        digest.update(torch.round(sample * 1024).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]
