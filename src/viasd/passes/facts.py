"""What a pass's route depends on (passes/route.py `Facts`), read from the pass's model, cache, view and batcher.

Every caller of the route gathers its facts here: KV sessions (passes/session.py), training's conversations
(training/conversations.py) and calibration's teacher (calibration/teacher.py). The route imports none of the stacks
it chooses between; their verdicts are read here, above them: whether viasd's loop covers the model and runs on the
cache (passes/loop.py), whether the fused stack takes the view (passes/fused.py), whether the attention kernel takes
the model (passes/layer_loop.py). Gathering builds nothing: the verdicts that cost a check (the loop's coverage, the
fused stack's family and its agreement with viasd's decoder layer) are read when the model is prepared
(passes/prepare.py) and kept.
"""

from __future__ import annotations

from torch import nn
from transformers import DynamicCache

from viasd.models.stored import has_dense_weights
from viasd.passes import fused, loop
from viasd.passes.layer_loop import attention_kernel
from viasd.passes.route import Facts
from viasd.views.view import View


def gather(
    model: nn.Module,
    cache: DynamicCache | None,
    view: View | None,
    *,
    chunk: int | None = None,
    own_chunk: int | None = None,
    covered: bool | None = None,
    own_weights: bool = True,
    features: bool = False,
    masked: bool = False,
) -> Facts:
    """The facts of a pass of `model` as `view` on `cache` (None: a pass that keeps no cache) as they stand now.

    `chunk` and `own_chunk`: the batcher's (passes/batching.py), or a caller's that merges its own sequences' passes
    (None: no batcher); `covered`: `loop.covers(model)` where the caller read it already (a session, once);
    `own_weights`: whether a quantized view may read the positions without logits by the model's own weights
    (`QuantRecipe.own_weights_from`: False where every position must be the view's); `features`: a draft head
    follows the pass; `masked`: the pass brings its own attention mask."""
    skips = view is not None and view.mask is not None and not view.mask.is_full
    covered = loop.covers(model) if covered is None else covered
    runs = covered and cache is not None and loop.runs_on(model, cache)
    linears = view.linears if view is not None and not skips else None
    # A long pass of a quantized view (a prompt) may read the positions that need no logits with the model's own
    # weights, which are faster there. A model whose weights stay in its file's blocks has no dense copy to read them
    # with (models/stored.py).
    own_from = None
    if own_weights and linears is not None and has_dense_weights(model):
        own_from = linears.recipe.own_weights_from(next(model.parameters()).device.type)
    if not runs:
        return Facts(
            False, chunk=chunk, own_chunk=own_chunk, skips=skips, own_weights_from=own_from, features=features,
            masked=masked,
        )  # fmt: skip
    # A view that skips whole layers runs fused where its layers would: the stack leaves those layers out.
    whole = skips and fused.skips_whole_layers(view)
    fits = (not skips and fused.fits(model, view)) or (whole and fused.fits(model, fused.layers_of(view)))
    return Facts(
        True, chunk=chunk, own_chunk=own_chunk, skips=skips, fused=fits, attention_kernel=attention_kernel(model),
        own_weights_from=own_from, features=features, masked=masked,
    )  # fmt: skip
