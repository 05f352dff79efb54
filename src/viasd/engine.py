"""An engine: the loaded models and the decoding methods built on them, shared by CLI, bench and server."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder, GenerationConfig, GenerationResult
from viasd.decode.hf_assisted import HFAssistedDecoder
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import ViasdError
from viasd.methods import MethodSpec, parse_method
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.models.loading import LoadedModel, check_same_vocabulary, load_model
from viasd.models.routing import RoutingMask, num_decoder_layers
from viasd.prompting import Message, encode_messages
from viasd.routing.masks import spread_mask
from viasd.routing.profile import RoutingProfile, load_profile, model_fingerprint, shipped_profile_path
from viasd.verify.gates import Gate


@dataclass
class EngineSpec:
    """Which models to load and how."""

    target: str = DEFAULT_TARGET
    drafter: str = DEFAULT_DRAFTER
    device: str | None = None
    dtype: str = "auto"
    device_map: str | None = None
    gamma: int | None = None  # draft tokens per round; None: the profile's, else 4
    self_skip_ratio: float = 0.25
    profile: str | None = None

    def __post_init__(self) -> None:
        # 0 must not silently mean "the default" (the decoders read a falsy gamma as unset).
        if self.gamma is not None and self.gamma < 1:
            raise ViasdError(f"--gamma must be >= 1 (draft tokens per round), got {self.gamma}")


class Engine:
    """Loads the target once (and the drafter when a method needs it) and builds decoders on demand."""

    def __init__(self, spec: EngineSpec, target: LoadedModel | None = None) -> None:
        self.spec = spec
        self.target = target or self._load(spec.target)
        self._drafter: LoadedModel | None = None
        self._decoders: dict[str, Decoder] = {}
        self._profiles: dict[str, RoutingProfile] = {}

    def _load(self, name: str) -> LoadedModel:
        return load_model(name, device=self.spec.device, dtype=self.spec.dtype, device_map=self.spec.device_map)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.target.tokenizer

    @property
    def drafter(self) -> LoadedModel:
        """The small drafter model, loaded on first use and checked against the target's vocabulary."""
        if self._drafter is None:
            drafter = self._load(self.spec.drafter)
            check_same_vocabulary(drafter, self.target)
            self._drafter = drafter
        return self._drafter

    def self_mask(self) -> RoutingMask:
        """The routing mask of the self-drafter: the profile's slim mask when there is one, else a spread mask."""
        path = self.spec.profile or shipped_profile_path()
        if path is not None:
            profile = load_profile(path)
            if profile.target.get("fingerprint") == model_fingerprint(self.target.model):
                return profile.masks[0]
        return spread_mask(num_decoder_layers(self.target.model), self.spec.self_skip_ratio)

    def routing_profile(self, path: str | None = None) -> RoutingProfile:
        """A routing profile for VIA-SD, checked against the loaded models: `path`, else --profile, else the
        one shipped for the default pair."""
        path = path or self.spec.profile or shipped_profile_path()
        if path is None:
            raise ViasdError("no routing profile: run `viasd calibrate` for this model pair and pass --profile")
        key = str(path)
        if key not in self._profiles:
            profile = load_profile(path)
            profile.check_models(self.target.model, self.drafter.model)
            self._profiles[key] = profile
        return self._profiles[key]

    def _via(self, spec: MethodSpec) -> Decoder:
        profile = self.routing_profile(spec.profile)
        exact = spec.base == "via-exact"
        return TieredDecoder(
            self.target.model,
            self.target.tokenizer,
            ModelDrafter(self.drafter.model, name="small"),
            profile.masks,
            Gate.exact() if exact else profile.gate,
            gamma=spec.gamma or self.spec.gamma or profile.gamma,
            cap=spec.cap or profile.cap,
            method=spec.name,
            pregate=profile.pregate if spec.pregate is None else spec.pregate,
        )

    def _build(self, spec: MethodSpec) -> Decoder:
        target, tok = self.target.model, self.target.tokenizer
        gamma = spec.gamma or self.spec.gamma or 4
        name = spec.name
        match spec.base:
            case "plain":
                return PlainDecoder(target, tok)
            case "sd":
                drafter = ModelDrafter(self.drafter.model, name="small")
                return SpeculativeDecoder(target, tok, drafter, gamma, method=name)
            case "lookup":
                return SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma, method=name)
            case "self":
                drafter = ModelDrafter(target, self.self_mask(), name="self")
                return SpeculativeDecoder(target, tok, drafter, gamma, method=name)
            case "hf-assisted":
                return HFAssistedDecoder(target, tok, self.drafter.model, spec.gamma or self.spec.gamma, method=name)
            case _:
                return self._via(spec)

    def decoder(self, method: str) -> Decoder:
        """The decoder for a method name or variant (`via:gamma=4`; built once, then reused)."""
        spec = parse_method(method)
        if spec.name not in self._decoders:
            self._decoders[spec.name] = self._build(spec)
        return self._decoders[spec.name]

    def encode(self, messages: Sequence[Message], chat: bool = True) -> list[int]:
        return encode_messages(self.target.tokenizer, messages, chat=chat)

    def generate(
        self,
        prompt_ids: Sequence[int],
        method: str = "plain",
        config: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        return self.decoder(method).generate(prompt_ids, config, on_text=on_text)
