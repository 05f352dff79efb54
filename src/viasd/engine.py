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
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.models.loading import LoadedModel, check_same_vocabulary, load_model
from viasd.models.routing import RoutingMask, num_decoder_layers
from viasd.prompting import Message, encode_messages
from viasd.routing.masks import spread_mask
from viasd.routing.profile import RoutingProfile, load_profile, model_fingerprint, shipped_profile_path
from viasd.verify.gates import Gate

# method name -> what it is, for help texts and listings
METHODS: dict[str, str] = {
    "plain": "plain autoregressive decoding of the target (baseline)",
    "sd": "classic speculative decoding with the small drafter model (exact)",
    "lookup": "speculative decoding with prompt-lookup (n-gram) drafts (exact)",
    "self": "self-speculative decoding: the target under a routing mask drafts (exact)",
    "via": "VIA-SD: drafter -> slim verifier (routed target) -> full target, gated per token (relaxed)",
    "via-exact": "VIA-SD machinery with every token sent to the full target (equals sd)",
    "hf-assisted": "Hugging Face transformers' assisted generation with the small drafter (reference, exact)",
}


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


class Engine:
    """Loads the target once (and the drafter when a method needs it) and builds decoders on demand."""

    def __init__(self, spec: EngineSpec, target: LoadedModel | None = None) -> None:
        self.spec = spec
        self.target = target or self._load(spec.target)
        self._drafter: LoadedModel | None = None
        self._decoders: dict[str, Decoder] = {}
        self._profile: RoutingProfile | None = None

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

    @property
    def profile(self) -> RoutingProfile:
        """The routing profile for VIA-SD: --profile, else the one shipped for the default pair."""
        if self._profile is None:
            path = self.spec.profile or shipped_profile_path()
            if path is None:
                raise ViasdError("no routing profile: run `viasd calibrate` for this model pair and pass --profile")
            profile = load_profile(path)
            profile.check_models(self.target.model, self.drafter.model)
            self._profile = profile
        return self._profile

    def _via(self, exact: bool) -> Decoder:
        profile = self.profile
        drafter = ModelDrafter(self.drafter.model, name="small")
        return TieredDecoder(
            self.target.model,
            self.target.tokenizer,
            drafter,
            profile.masks,
            Gate.exact() if exact else profile.gate,
            gamma=self.spec.gamma or profile.gamma,
            cap=profile.cap,
            method="via-exact" if exact else "via",
        )

    def _builders(self) -> dict[str, Callable[[], Decoder]]:
        target, tok, gamma = self.target.model, self.target.tokenizer, self.spec.gamma or 4
        return {
            "plain": lambda: PlainDecoder(target, tok),
            "sd": lambda: SpeculativeDecoder(target, tok, ModelDrafter(self.drafter.model, name="small"), gamma),
            "lookup": lambda: SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma, method="lookup"),
            "self": lambda: SpeculativeDecoder(
                target, tok, ModelDrafter(target, self.self_mask(), name="self"), gamma, method="self"
            ),
            "via": lambda: self._via(exact=False),
            "via-exact": lambda: self._via(exact=True),
            "hf-assisted": lambda: HFAssistedDecoder(target, tok, self.drafter.model, self.spec.gamma),
        }

    def decoder(self, method: str) -> Decoder:
        """The decoder for a method name (built once, then reused)."""
        if method not in self._decoders:
            builders = self._builders()
            if method not in builders:
                raise ViasdError(f"unknown method {method!r}; choose one of: {', '.join(builders)}")
            self._decoders[method] = builders[method]()
        return self._decoders[method]

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
