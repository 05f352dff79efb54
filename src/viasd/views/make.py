"""How a quantized view of a loaded model is made: from its cached copies when sound ones are there, else
quantized now (with calibration sequences for smoothing, or the blocks of the GGUF file the model came from) and
cached (views/store.py)."""

from __future__ import annotations

from viasd.errors import ViasdError
from viasd.models.loading import LoadedModel
from viasd.prompting import encode_prompt
from viasd.views.gguf import GgufWeights, source_gguf
from viasd.views.recipe import QuantRecipe
from viasd.views.store import SMOOTHING_TEXTS, cached_quantize
from viasd.views.view import View


def quantized_view(model: LoadedModel, recipe: QuantRecipe) -> View:
    """`model`'s view by `recipe`, its quantized copies loaded from viasd's cache or made (and cached) now."""

    def sequences() -> list[list[int]]:
        return [encode_prompt(model.tokenizer, text) for text in SMOOTHING_TEXTS]

    def gguf() -> GgufWeights:
        path = source_gguf(model.name, model.path)
        if path is None:
            raise ViasdError(
                f"quantization {recipe.name} takes the blocks of the GGUF file a model came from; {model.name} was "
                "not loaded from one (use int4a8, which quantizes it here)"
            )
        return GgufWeights(path)

    linears = cached_quantize(model.model, recipe, sequences, gguf=gguf)
    linears.prepare()
    return View(linears=linears)
