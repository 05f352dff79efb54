"""The calibration data: the target's greedy continuations of the prompts (kept in the work file, slow to make) and
the teacher-forced passes over them that the mask search and the gate records read."""

from __future__ import annotations

from collections.abc import Sequence

from viasd.calibration.progress import steps
from viasd.calibration.teacher import TeacherSequence, teacher_force
from viasd.calibration.workfile import WorkFile, work_key
from viasd.decode.base import GenerationConfig
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import LoadedModel
from viasd.prompting import encode_prompt
from viasd.views.quantize import QuantizedLinears
from viasd.views.view import View

Pairs = list[tuple[list[int], list[int]]]  # (prompt ids, the target's greedy continuation)


def continuations(
    target: LoadedModel,
    drafter: LoadedModel,
    texts: Sequence[str | list[int]],
    new_tokens: int,
    work: WorkFile,
    resume: bool,
    progress: bool = False,
    stop_strings: tuple[str, ...] = (),
    base: QuantizedLinears | None = None,
) -> Pairs:
    """(prompt ids, the target's greedy continuation) per prompt (a text, encoded as a chat turn, or prompt ids as
    they are), generated with exact SD for speed and kept in the work file (keyed by target, dtype, length and
    prompts) for `--resume` and `--reselect`. A continuation ends early at one of `stop_strings` (where the
    benchmark stops the task too). `base`: the target's view to continue with (None: as loaded)."""
    param = next(target.model.parameters())
    stops = [list(stop_strings)] if stop_strings else []  # keys of runs without stops stay as they were
    on = [base.recipe.name] if base is not None else []  # keys of the target as loaded stay as they were
    key = work_key(
        "continuations", model_fingerprint(target.model), str(param.dtype), new_tokens, list(texts), *stops, *on
    )
    cached = work.get(key) if resume else None
    if isinstance(cached, list):
        return [(list(p), list(c)) for p, c in cached]
    drafts = ModelDrafter(drafter.model, name="small")
    view = View(linears=base) if base is not None else None
    decoder = SpeculativeDecoder(target.model, target.tokenizer, drafts, view=view)  # any gamma: the same text
    pairs: Pairs = []
    for text in steps(texts, "continuations", progress):
        ids = encode_prompt(target.tokenizer, text) if isinstance(text, str) else list(text)
        result = decoder.generate(ids, GenerationConfig(max_new_tokens=new_tokens, stop_strings=stop_strings))
        if len(result.tokens) >= 2:
            pairs.append((ids, result.tokens))
    work.put(key, pairs)
    return pairs


def teacher_sequences(target: LoadedModel, pairs: Pairs, base: QuantizedLinears | None = None) -> list[TeacherSequence]:
    """The target's (as its view `base`, else as loaded) teacher-forced pass over each (prompt, continuation),
    scored from the continuation on."""
    view = View(linears=base) if base is not None else None
    return [teacher_force(target.model, prompt + cont, len(prompt), view) for prompt, cont in pairs]
