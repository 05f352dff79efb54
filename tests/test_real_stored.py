"""The real default models as their GGUF files store them (models/stored.py): no dense copy held, the same
fingerprint as the dense copy (so shipped profiles and heads fit), and the dense copy written for runtimes that need
one (vLLM) equal to the one viasd makes from the file."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from viasd.models.export import ensure_dense_directory
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import load_model
from viasd.models.stored import densify, is_stored
from viasd.profile import default_profile_path, load_profile

pytestmark = pytest.mark.real


def test_the_default_target_loads_as_its_file_stores_it_and_fits_the_shipped_profile():
    loaded = load_model("qwen2.5-coder-1.5b", device="cpu")
    assert is_stored(loaded.model)
    dense_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert dense_bytes < 20e6  # norms and biases only: no layer's weights were made dense
    profile = load_profile(default_profile_path(True))
    assert profile.target["fingerprint"] == model_fingerprint(loaded.model)


def test_the_dense_copy_for_other_runtimes_is_the_one_viasd_makes_from_the_file():
    directory = ensure_dense_directory("smollm2-135m", progress=False)
    written = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    loaded = load_model("smollm2-135m", device="cpu", dtype="bf16")
    assert is_stored(loaded.model) and densify(loaded.model, "to compare")
    mine = dict(loaded.model.named_parameters())
    theirs = dict(written.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)  # the file's weights, rounded once to bf16
    assert model_fingerprint(written) == model_fingerprint(loaded.model)
    assert ensure_dense_directory("smollm2-135m", progress=False) == directory  # made once
