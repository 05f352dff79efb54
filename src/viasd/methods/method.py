"""A method as a value: what it is (`Method`), a variant of it as parsed once at the edge (`MethodSpec`), and what a
method builds its decoder from (`Parts`, which the engine provides)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from viasd.methods.options import HEAD_DRAFTERS

if TYPE_CHECKING:
    from viasd.decode.base import Decoder
    from viasd.drafters.suffix import SuffixStore
    from viasd.heads.file import HeadFile
    from viasd.models.loading import LoadedModel
    from viasd.profile import RoutingProfile
    from viasd.spec import EngineSpec
    from viasd.views.layer_skip import LayerMask
    from viasd.views.recipe import QuantRecipe, TargetQuant
    from viasd.views.view import View


class Parts(Protocol):
    """What a method builds its decoder from; the Engine provides it."""

    @property
    def spec(self) -> EngineSpec:
        """The engine's settings: models, and what every method shares (--gamma, --quant, --drafter-quant)."""
        ...

    def target_recipe(self, asked: TargetQuant | None = None) -> QuantRecipe | None:
        """The recipe of the view the target runs as (None: as loaded): `asked` (a variant's quant), else --quant,
        else as its file stores it."""
        ...

    @property
    def target(self) -> LoadedModel: ...

    @property
    def drafter(self) -> LoadedModel: ...

    def routing_profile(self, path: str | None = None) -> RoutingProfile: ...

    def profile_as_read(self, path: str | None = None) -> RoutingProfile: ...

    def self_mask(self) -> LayerMask: ...

    def gguf(self) -> Path:
        """The target's GGUF file (for runtimes that read GGUF)."""
        ...

    def decoder(self, method: MethodSpec | str) -> Decoder:
        """The decoder of another method (built once)."""
        ...

    def drafter_fits(self) -> bool | None:
        """Whether the drafter shares the target's tokenizer (None: unknown without loading it)."""
        ...

    def quantized(self, model: LoadedModel, recipe: QuantRecipe | None) -> View | None:
        """The quantized view of `model` by `recipe` (None: no view), made once and cached."""
        ...

    def draft_head(self, path: str | None = None) -> HeadFile:
        """The target's draft head (`path`, else the one trained here, else a shipped one), read once."""
        ...

    def suffix_store(self, method: str = "") -> SuffixStore | None:
        """Finished generations' tokens the suffix drafters of `method` copy from too (None: off)."""
        ...


def first_set(*values: Any) -> Any:
    """The first of `values` that is set (not None): a variant's option, then the engine's, then a default. (Not
    `or`: 0 and 0.0 are settings.)"""
    return next((value for value in values if value is not None), None)


@dataclass(frozen=True)
class Method:
    """A decoding method: what it is, which options its variants take, and how its decoder is built."""

    name: str
    description: str
    build: Callable[[Parts, MethodSpec], Decoder]
    options: tuple[str, ...] = ()
    uses_drafter: bool = False
    exact: bool = True
    # Which target it runs: "view" (the target as --quant or its quant= says, by default as its file stores it),
    # "dense" (the model as loaded, whatever the default), "profile" (the view its routing profile was calibrated on:
    # via's) or "file" (llama.cpp).
    target: str = "view"
    # Whether it applies min_p, the penalties, logit_bias and min_tokens (verify/penalties.py); else it refuses them.
    penalties: bool = True
    # Whether it reports the target's log-probabilities (decode/logprobs.py); else a request for them is refused.
    logprobs: bool = True


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name: the method and the options its variant overrides (`methods.registry.parse_method`)."""

    name: str  # as written, e.g. "via:gamma=4"
    method: Method
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return self.method.name

    @property
    def uses_drafter(self) -> bool:
        """Whether the variant needs the small drafter model (`sd:drafter=lookup` does not)."""
        return self.method.uses_drafter and self.options.get("drafter") not in ("lookup", *HEAD_DRAFTERS)

    @property
    def exact(self) -> bool:
        """Exact with respect to the target as run (its view: a quantized target is another model; `target_as_run`
        in `Engine.describe` names it)."""
        return self.method.exact

    def get(self, key: str) -> Any:
        """An option's value, or None when the variant leaves it at the method's default."""
        return self.options.get(key)

    def build(self, parts: Parts) -> Decoder:
        """This variant's decoder, built from `parts`."""
        return self.method.build(parts, self)
