"""An engine: the loaded models and the decoding methods built on them, shared by CLI, bench and server."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from viasd.errors import ViasdError
from viasd.methods import MethodSpec, first_set, parse_method
from viasd.models.loading import LoadedModel, check_same_vocabulary, load_model
from viasd.spec import EngineSpec
from viasd.views.recipe import DENSE, QuantRecipe, TargetQuant

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from viasd.decode.base import Decoder, GenerationConfig, GenerationResult
    from viasd.drafters.suffix import SuffixStore
    from viasd.heads.file import HeadFile
    from viasd.profile import RoutingProfile
    from viasd.prompting import Message
    from viasd.views.layer_skip import LayerMask
    from viasd.views.view import View


class Engine:
    """The target (and the drafter, loaded when a method first needs it) and the decoders built on them.

    Already loaded models can be handed in (`target=`, `drafter=`); otherwise they load from the spec.
    """

    def __init__(self, spec: EngineSpec, target: LoadedModel | None = None, drafter: LoadedModel | None = None) -> None:
        self._spec = spec
        # Seconds spent making things once (loading models, making views), kept apart from decoding: what a user
        # waits for at start, reported by `describe` (--json, the bench's environment file).
        self.setup_seconds: dict[str, float] = {}
        self.target = target or self._load(spec.target)
        self._drafter = drafter
        self._drafter_checked = False
        self._decoders: dict[tuple[str, int], Decoder] = {}
        self._profiles: dict[str, RoutingProfile] = {}  # by path, read once
        # (path, with its drafter) of the profiles checked against the models (self_mask needs no drafter)
        self._checked_profiles: set[tuple[str, bool]] = set()
        self._views: dict[tuple[int, QuantRecipe], View] = {}
        self._heads: dict[str | None, HeadFile] = {}
        self._stored: tuple[QuantRecipe | None] | None = None  # the target's view as its file stores it, once known
        self._said_dense = False
        self._suffix_stores: dict[str, SuffixStore] = {}

    def _load(self, name: str) -> LoadedModel:
        from viasd.passes.prepare import prepare

        start = time.perf_counter()
        loaded = load_model(name, device=self.spec.device, dtype=self.spec.dtype, device_map=self.spec.device_map)
        prepare(loaded.model)
        self.setup_seconds[f"load {name}"] = time.perf_counter() - start
        return loaded

    @property
    def spec(self) -> EngineSpec:
        return self._spec

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.target.tokenizer

    def quantized(self, model: LoadedModel, recipe: QuantRecipe | None) -> View | None:
        """`model`'s quantized view by `recipe` (None: none, the model as loaded, whose dense weights a model stored in
        its file's blocks then gets, once, with one line), made once (cached on disk) and shared."""
        if recipe is None:
            from viasd.models.stored import densify

            start = time.perf_counter()
            if densify(model.model, f"{model.name} runs as loaded"):
                self.setup_seconds[f"dense copy of {model.name}"] = time.perf_counter() - start
            return None
        key = (id(model.model), recipe)
        if key not in self._views:
            from viasd.views.make import quantized_view

            start = time.perf_counter()
            self._views[key] = quantized_view(model, recipe)
            self.setup_seconds[f"view {model.name} {recipe.name}"] = time.perf_counter() - start
        return self._views[key]

    def target_recipe(self, asked: TargetQuant | None = None) -> QuantRecipe | None:
        """The recipe of the view the target runs as (None: as loaded): `asked` (a method variant's quant=), else
        --quant, else as its file stores it (`stored_recipe`)."""
        chosen = first_set(asked, self.spec.quant)
        if isinstance(chosen, QuantRecipe):
            return chosen
        if chosen == DENSE:
            if not self._said_dense and not self.from_gguf():
                self._said_dense = True
                print(
                    f"quant none: {self.spec.target} does not come from a GGUF file, so it has no dense copy other "
                    "than itself; it runs as loaded",
                    file=sys.stderr,
                )
            return None
        return self.stored_recipe()

    def stored_recipe(self) -> QuantRecipe | None:
        """The target's view as its file stores it: the `gguf` view of a model from a GGUF file with blocks viasd's
        kernels take; None for any other model (as loaded). Decided once; where a GGUF file has no such blocks, or
        the view's kernel does not run where the target is (a GPU, a CPU viasd's kernels are not built for), one
        line on stderr says so and the target runs as its dense copy; where some of its block types have no kernel,
        one line names them (those tensors run as int8 weight-only)."""
        if self._stored is None:
            from viasd.auto import int4a8_is_fast
            from viasd.views.gguf import stored_view

            recipe, why = stored_view(self.spec.target, self.target.path)
            device = next(self.target.model.parameters()).device
            if recipe is not None and not int4a8_is_fast(device):
                recipe = None
                why = (
                    f"the 4-bit kernel of its GGUF file's view does not run on {device} here, so it runs as its dense "
                    "copy (--quant gguf runs the view anyway, on torch ops)"
                )
            if why is not None:
                print(f"target: {why}", file=sys.stderr)
            self._stored = (recipe,)
        return self._stored[0]

    def from_gguf(self) -> bool:
        """Whether the target comes from a GGUF file (a default model, or loaded from a .gguf file)."""
        from viasd.models.catalog import find_default_model

        return find_default_model(self.spec.target) is not None or str(self.target.path).lower().endswith(".gguf")

    def target_as_run(self, method: MethodSpec) -> str:
        """Which target `method` runs, in words: the view of the target its settings choose, the one its routing
        profile was calibrated on (via), the dense copy (hf-assisted), or the GGUF file itself (llama.cpp); what its
        exactness is with respect to."""
        from viasd.models.catalog import find_default_model

        entry = find_default_model(self.spec.target)
        file = entry.gguf_filename if entry is not None else Path(str(self.target.path)).name
        if method.method.target == "file":
            return f"{file}, run by llama.cpp"
        if method.base == "auto":  # the method it chose
            chosen = getattr(self.decoder(method), "choice", {}).get("chosen")
            if chosen:
                return self.target_as_run(parse_method(chosen))
        recipe = None
        if method.method.target == "view":
            recipe = self.target_recipe(method.get("quant"))
        elif method.method.target == "profile":  # via: the view its routing profile was calibrated on
            recipe = self.profile_as_read(method.get("profile")).target_quant
        dtype = str(next(self.target.model.parameters()).dtype).removeprefix("torch.")
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
        if recipe is None:
            return f"{dtype} copy of {file}" if self.from_gguf() else f"as loaded ({dtype})"
        if recipe.gguf:
            return f"gguf view of {file}"
        return f"{recipe.name} view of the {dtype} weights"

    def draft_head(self, path: str | None = None) -> HeadFile:
        """The target's draft head: `path`, else the one `viasd train-drafter` made here, else a shipped one; read
        (and checked against the target) once."""
        if path not in self._heads:
            from viasd.heads.find import find_head

            start = time.perf_counter()
            self._heads[path] = find_head(self.target.model, path)
            self.setup_seconds["draft head"] = time.perf_counter() - start
        return self._heads[path]

    def suffix_store(self, method: str = "") -> SuffixStore | None:
        """Finished generations' tokens (prompt and answer) that this engine's suffix drafters copy from as well,
        made on first use; None where --suffix-cache is 0. One store for every method, or with
        `suffix_per_method` (the bench) one per method, so that no method drafts from another's answer to a task."""
        if self.spec.suffix_cache <= 0:
            return None
        key = method if self.spec.suffix_per_method else ""
        if key not in self._suffix_stores:
            from viasd.drafters.suffix import SuffixStore

            self._suffix_stores[key] = SuffixStore(self.spec.suffix_cache)
        return self._suffix_stores[key]

    def forget_finished(self) -> None:
        """Empty every suffix store: what was generated so far is no longer copied from (the bench's warm-up)."""
        for store in self._suffix_stores.values():
            store.clear()

    @property
    def drafter(self) -> LoadedModel:
        """The small drafter model, loaded on first use and checked against the target's vocabulary (a default
        drafter is checked before it is fetched)."""
        if self._drafter is None:
            if self.drafter_fits() is False:
                raise ViasdError(
                    f"the drafter {self.spec.drafter!r} does not share the tokenizer of the target "
                    f"{self.spec.target!r}: pass --drafter with a model of the target's family, or use a method "
                    "that needs no drafter (plain, lookup, self)"
                )
            self._drafter = self._load(self.spec.drafter)
        if not self._drafter_checked:
            check_same_vocabulary(self._drafter, self.target)
            self._drafter_checked = True
        return self._drafter

    def drafter_fits(self) -> bool | None:
        """Whether the drafter shares the target's tokenizer, known without loading it when it is a default
        model (its vocabulary fingerprint is pinned); None when only loading it would tell."""
        from viasd.models.catalog import find_default_model
        from viasd.models.loading import has_padding, vocabulary_fingerprint

        if self._drafter is not None:
            return True if self._drafter_checked else None
        entry = find_default_model(self.spec.drafter)
        if entry is None or not entry.vocabulary:
            return None
        if vocabulary_fingerprint(self.target.tokenizer) == entry.vocabulary:
            return True
        # A GGUF file's vocabulary padded to another width (a 7B's) hashes otherwise: loading tells.
        return None if has_padding(self.target.tokenizer) else False

    def _profile_path(self, path: str | None) -> str | Path | None:
        return path or self.spec.profile or self.default_profile()

    def default_profile(self) -> Path | None:
        """The shipped profile for the default pair that suits where the target runs (`default_profile_path`): the
        one calibrated on the file's blocks where the target runs as them, else the int4a8 one on a CPU that viasd's
        kernels are built for, whether or not a compiler is there to build them (without one its views run on torch
        ops, slowly, and say so), so that what `via` writes depends on the CPU only."""
        from viasd.kernels.build import BUILDS, Build, choose_build
        from viasd.kernels.cpu import cpu_flags
        from viasd.profile import default_profile_path

        on_cpu = next(self.target.model.parameters()).device.type == "cpu"
        recipe = self.stored_recipe()
        kernels = on_cpu and isinstance(choose_build(BUILDS, cpu_flags()), Build)
        return default_profile_path(kernels, stored=recipe is not None and recipe.gguf)

    def gguf(self) -> Path:
        """The target's GGUF file: the verified file of a default model (assembled once), or the file it was
        loaded from."""
        from viasd.views.gguf import source_gguf

        path = source_gguf(self.spec.target, self.target.path)
        if path is None:
            raise ViasdError(f"llama.cpp reads GGUF files: load the target from a .gguf file, not {self.target.path}")
        return path

    def self_mask(self) -> LayerMask:
        """The self-drafter's layer mask: the profile's slim mask when it fits this target and skips layers, else a
        spread mask (a profile whose slim view is quantized, not cut, has a full mask: drafting with it would be the
        target's own pass)."""
        from viasd.models.fingerprint import model_fingerprint
        from viasd.views.layer_skip import num_decoder_layers, spread_mask

        path = self._profile_path(None)
        if path is not None:
            profile = self._read_profile(path)
            mask = profile.masks[0]
            if profile.target.get("fingerprint") == model_fingerprint(self.target.model) and not mask.is_full:
                return mask
        return spread_mask(num_decoder_layers(self.target.model), self.spec.self_skip_ratio)

    def routing_profile(self, path: str | None = None) -> RoutingProfile:
        """A routing profile for VIA-SD, checked against the loaded models: `path`, else --profile, else the
        one shipped for the default pair. Its drafter is checked where the small drafter is loaded (a method that
        drafts with it loads it first); one that drafts otherwise (the head, lookup) never loads it for the check."""
        found = self._profile_path(path)
        profile = self.profile_as_read(path)
        # A profile whose drafter is the target's own view needs no second model.
        drafter = None if profile.self_drafter or self._drafter is None else self._drafter.model
        key = (str(found), drafter is not None)
        if key not in self._checked_profiles:
            profile.check_models(self.target.model, drafter)
            self._checked_profiles.add(key)
        return profile

    def profile_as_read(self, path: str | None = None) -> RoutingProfile:
        """The routing profile `routing_profile` would give, read but not yet checked against the models (so that
        what it says about itself, such as the view it was calibrated on, is known without loading the drafter)."""
        found = self._profile_path(path)
        if found is None:
            raise ViasdError("no routing profile: run `viasd calibrate` for this model pair and pass --profile")
        return self._read_profile(found)

    def _read_profile(self, path: str | Path) -> RoutingProfile:
        """The routing profile at `path`, read once per engine, whichever method needs it first."""
        from viasd.profile import load_profile

        key = str(path)
        if key not in self._profiles:
            self._profiles[key] = load_profile(path)
        return self._profiles[key]

    def decoder(self, method: MethodSpec | str, slot: int = 0) -> Decoder:
        """The decoder for a method or variant (`via:gamma=4`), built once per `slot`, then reused. A decoder holds
        its generation's KV sessions, so generations that run at the same time (a server's) each use a slot of their
        own; the models and their views are shared. `method` as parsed at the caller's edge (`parse_method`), or its
        name, parsed here only when its decoder is first built."""
        name = method.name if isinstance(method, MethodSpec) else method.strip()
        key = (name, slot)
        if key not in self._decoders:
            spec = method if isinstance(method, MethodSpec) else parse_method(method)
            self._decoders[key] = spec.build(self if slot == 0 else _Slot(self, slot))
        return self._decoders[key]

    def describe(self, method: MethodSpec | str) -> dict[str, Any]:
        """What a method runs here, as built: whether it is exact, the target's view, the drafter, slim views and
        routing profile it uses, and which of viasd's kernels run (CPU) or why not."""
        spec = method if isinstance(method, MethodSpec) else parse_method(method)
        decoder = self.decoder(spec)
        # Exact with respect to the target as run, which `target_as_run` names.
        described: dict[str, Any] = {"method": spec.name, "exact": spec.exact}
        described["target_as_run"] = self.target_as_run(spec)
        described.update(decoder.describe())
        described["setup_seconds"] = {what: round(seconds, 3) for what, seconds in self.setup_seconds.items()}
        if next(self.target.model.parameters()).device.type == "cpu":
            from viasd.kernels.state import kernel_states

            described["kernels"] = kernel_states()
        return described

    def encode(self, messages: Sequence[Message], chat: bool = True) -> list[int]:
        from viasd.prompting import encode_messages

        return encode_messages(self.target.tokenizer, messages, chat=chat)

    def generate(
        self,
        prompt_ids: Sequence[int],
        method: MethodSpec | str = "plain",
        config: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
        slot: int = 0,
    ) -> GenerationResult:
        return self.decoder(method, slot).generate(prompt_ids, config, on_text=on_text)

    @property
    def loaded_models(self) -> list[LoadedModel]:
        """The models loaded so far (the drafter loads when a method first needs it)."""
        return [self.target] + ([self._drafter] if self._drafter is not None else [])


class _Slot:
    """The engine as a method's builder sees it for one slot: the same models and views, other decoders' of the same
    slot (`auto` builds the method it chose)."""

    def __init__(self, engine: Engine, slot: int) -> None:
        self._engine, self._slot = engine, slot

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def decoder(self, method: MethodSpec | str) -> Decoder:
        return self._engine.decoder(method, self._slot)
