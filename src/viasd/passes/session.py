"""KV-cache sessions: one sequence's cache on one model, extended by blocks and cropped back.

Cache invariants (tested in tests/test_session.py):

* `tokens` are committed: for every layer that the session's base view runs, cache positions
  [0, len(tokens)) hold exactly the K/V that one fresh forward pass of that view over `tokens` writes.
* `pending` tokens sit beyond that frontier. They were processed by a sub-view (a slim verifier: layers
  skipped, weights quantized, or both), so only the layers that view runs hold entries for them, and those
  entries differ from what the base view would write. They are never promoted to committed: any base-view
  forward first crops every layer back to len(tokens), then recomputes.
* Layer 0 always runs (LayerMask enforces it), so the cache length that transformers reads from
  layer 0 is len(tokens) + len(pending), which is where new positions start.
* transformers sizes each attention mask from the first cache layer of its kind (sliding window or full
  attention). A sub-view that skips such a layer's attention leaves it behind the pending entries, so it
  never stacks a pass on pending entries: it drops them and starts again at the committed frontier.

The cache is made from the model's config, so sliding-window layers get sliding cache layers. They are
told to keep their past (transformers' "past recording") so that a rollback can restore the window, but
each crop trims them back to the window that ends at the cut: a later crop may only remove what was added
since. So on such caches a slim pass never reuses part of the pending entries; it drops them all (one crop
of what the previous slim pass added) and recomputes. Cropping goes through each layer's own `crop`,
layer by layer, because layers hold different lengths while pending entries exist.

Each pass takes one route (passes/route.py: the model's own forward, viasd's loop, the fused stack, merged by a
batcher, in chunks, or split between the model's weights and a view's), decided once at its top (`_run`) and counted
(`routes`).

Passes return their logits where the model computed them (docs/gpu.md): on a GPU, reading a tensor on the host
waits for every queued kernel, so the decoders decide on the device and move one small outcome per round to the
host. Token ids go up without waiting (from pinned memory), and ids already on the device (a drafter's own draft
tokens) are fed as they are: their values reach `tokens` when the caller, which moves them to the host once per
round anyway, hands them over (`learn`), or else when `tokens` is next read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache

from viasd.passes import fused, loop
from viasd.passes.batching import PassBatcher, batcher_of
from viasd.passes.cache_layer import growing_cache
from viasd.passes.facts import gather
from viasd.passes.features import FeatureStore, head_inputs
from viasd.passes.loop import Segment
from viasd.passes.route import Facts, Leg, Route, Schedule, Stack, decide
from viasd.views.view import View, ViewLike, applied, as_view


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def upload_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Token ids as a LongTensor on `device`; to a GPU the copy is queued without waiting for the device (a copy
    from pageable memory would wait for every kernel queued before it)."""
    host = torch.tensor(list(ids), dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


Ids = Sequence[int] | torch.Tensor  # host token ids, or a 1-D LongTensor of ids on the device


def new_cache(model: nn.Module) -> DynamicCache:
    """An empty cache shaped by the model's config (sliding-window layers included) that can be rolled back; its
    full-attention layers write each pass's entries in place (passes/cache_layer.py)."""
    cache = growing_cache(DynamicCache(config=model.config))
    cache.activate_past_recording()
    return cache


class KVSession:
    """A model, run as an optional base view, with the KV cache of one growing sequence."""

    def __init__(self, model: nn.Module, base_view: ViewLike = None) -> None:
        self.model = model
        self.base_view = as_view(base_view)
        self.cache = new_cache(model)
        self._tokens: list[int] = []
        self._unread: list[torch.Tensor] = []  # ids fed from the device after _tokens, values not on the host yet
        self.pending: list[int] = []
        self.pending_view: View | None = None
        self.forward_passes = 0  # of every view together
        self.pass_seconds = 0.0  # what those passes cost (one merged with other generations' counts whole)
        self.routes: dict[str, int] = {}  # those passes by the route they took (passes/route.py `Kind`)
        kinds = self.cache.is_sliding
        self.mask_size_layers = frozenset(kinds.index(kind) for kind in set(kinds))
        self.windowed = any(kinds)  # sliding-window layers: partial rollbacks of pending entries are unsafe
        self.short_passes = loop.covers(model)  # viasd's forward for passes of a few tokens (passes/loop.py)
        # The features (final hidden states) of the positions whose logits passes computed, for a draft head that
        # follows this session (drafters/head.py); None: not recorded.
        self.features: FeatureStore | None = None

    def _stacks(self, view: View) -> bool:
        """Whether a pass of `view` may go on top of pending entries (it runs every mask-size layer)."""
        mask = view.mask
        return mask is None or all(mask.attention[i] for i in self.mask_size_layers if i < mask.num_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokens(self) -> list[int]:
        """The committed tokens (ids fed from the device and not yet `learn`ed are read from it here)."""
        if self._unread:
            self._tokens.extend(torch.cat(self._unread).tolist())
            self._unread = []
        return self._tokens

    @property
    def committed(self) -> int:
        """How many tokens are committed, without reading any from the device."""
        return len(self._tokens) + sum(ids.numel() for ids in self._unread)

    def learn(self, values: Sequence[int]) -> None:
        """The values of the ids fed from the device since the last read, from a transfer the caller made anyway."""
        if len(values) != sum(ids.numel() for ids in self._unread):
            raise ValueError("learn needs one value per id fed from the device")
        self._tokens.extend(int(v) for v in values)
        self._unread = []

    def reset(self) -> None:
        """Forget the sequence (start a new generation)."""
        self.cache = new_cache(self.model)
        self._tokens = []
        self._unread = []
        self.pending = []
        self.pending_view = None
        if self.features is not None:
            self.features.reset()

    def adopt(self, cache: DynamicCache, tokens: Sequence[int]) -> None:
        """Start a generation from `cache`, which holds exactly the committed entries of `tokens` (a prefix cache's
        copy, passes/prefix_cache.py): no pending entries, no features."""
        self.reset()
        self.cache = cache
        self._tokens = list(tokens)

    def _crop_layers(self, length: int) -> None:
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        if self.features is not None:
            self.features.cut(length)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` committed tokens; drop every pending token."""
        length = min(length, self.committed)
        self._crop_layers(length)
        del self.tokens[length:]
        self.pending = []
        self.pending_view = None

    def truncate_pending(self, count: int) -> None:
        """Keep only the first `count` pending tokens."""
        count = min(count, len(self.pending))
        self._crop_layers(self.committed + count)
        del self.pending[count:]

    def route(self, tokens: int, view: View | None, keep: int) -> Route:
        """The route of a pass of `tokens` tokens of `view` whose last `keep` need logits (passes/route.py), as the
        session, its model and the model's batcher stand now."""
        return self._route(tokens, view, keep, batcher_of(self.model))

    def _route(self, tokens: int, view: View | None, keep: int, batcher: PassBatcher | None) -> Route:
        """The route with the batcher the pass will use (looked up once per pass)."""
        return decide(tokens, keep, self._facts(view, batcher))

    def _facts(self, view: View | None, batcher: PassBatcher | None) -> Facts:
        """What the route of a pass of `view` depends on now (passes/facts.py), with the batcher's chunks and
        whether a draft head follows this session (drafters/head.py gave it a store)."""
        chunk, own_chunk = (None, None) if batcher is None else (batcher.chunk, batcher.own_chunk)
        return gather(
            self.model, self.cache, view, chunk=chunk, own_chunk=own_chunk, covered=self.short_passes,
            features=self.features is not None,
        )  # fmt: skip

    def _run(self, ids: Ids, view: View | None, keep: int) -> torch.Tensor:
        """One pass of `view` over `ids`, by the route decided here, once; logits of the last `keep` positions.

        Which weights wrote a position's KV entries depends only on whether its logits were needed in a long pass
        (a split route), so plain decoding and a block verification of the same view still see the same cache.
        """
        batcher = batcher_of(self.model)
        route = self._route(len(ids), view, keep, batcher)
        kept = []
        for leg in route.legs:
            logits = self._leg(ids[leg.start : leg.stop], None if leg.own_weights else view, leg, batcher)
            if leg.keep and not leg.own_weights:
                kept.append(logits)
        self.forward_passes += 1  # one pass, whatever its legs
        self.routes[route.kind.value] = self.routes.get(route.kind.value, 0) + 1
        return torch.cat(kept) if len(kept) > 1 else kept[0]

    def _leg(self, ids: Ids, view: View | None, leg: Leg, batcher: PassBatcher | None) -> torch.Tensor:
        """One leg of a pass's route: float32 logits [leg.keep, V] where the model made them."""
        device = self.device
        input_ids = ids.to(device) if isinstance(ids, torch.Tensor) else upload_ids(ids, device)
        input_ids = input_ids.reshape(1, -1)
        keep = leg.keep
        if leg.schedule is Schedule.BATCHED:
            # Merged with other generations' passes of the same view (passes/batching.py).
            assert batcher is not None, "a batched leg has a batcher"
            start = self.cache.layers[0].get_seq_length()
            (logits, features), seconds = batcher.segment(view, Segment(self.cache, input_ids[0], keep), leg)
            if leg.features and self.features is not None and features is not None:
                self.features.write(start + input_ids.shape[1] - keep, features)
            logits = logits[None]
        elif leg.schedule is Schedule.QUEUED:
            assert batcher is not None, "a queued leg has a batcher"
            logits, seconds = batcher.alone(lambda: self._own_pass(input_ids, view, leg))
        else:
            start = time.perf_counter()
            logits = self._own_pass(input_ids, view, leg)
            seconds = time.perf_counter() - start
        self.pass_seconds += seconds
        # float32 logits where the model made them: no host copy (on a CPU this is the tensor it always was).
        return logits[0, logits.shape[1] - keep :].float()

    def _own_pass(self, input_ids: torch.Tensor, view: View | None, leg: Leg) -> torch.Tensor:
        """Logits [1, keep, V] of one pass of this session alone, by the leg's stack."""
        start = self.cache.layers[0].get_seq_length()
        skipped: tuple[int, ...] = ()
        if leg.stack is Stack.FUSED and view is not None and view.mask is not None and not view.mask.is_full:
            # The fused stack leaves the skipped layers out itself: only the view's layers are swapped in.
            skipped, view = tuple(view.mask.skipped_layers), fused.layers_of(view)
        with torch.inference_mode(), applied(self.model, view):
            if not leg.features or self.features is None:  # no head follows: no capture hook on the output head
                return loop.leg_pass(self.model, input_ids, self.cache, leg, skipped)
            with head_inputs(self.model) as seen:
                logits = loop.leg_pass(self.model, input_ids, self.cache, leg, skipped)
            if seen:  # the head read the kept positions' features: the last `keep` of this pass
                self.features.write(start + input_ids.shape[1] - leg.keep, seen[-1][-leg.keep :])
            return logits

    def forward(self, ids: Ids, keep: int = 1) -> torch.Tensor:
        """Commit `ids` after the committed tokens (base view); logits [keep, V] of the last positions, on the
        model's device. `ids` on the device stay there (see `learn`)."""
        if not len(ids):
            raise ValueError("forward needs at least one token")
        if self.pending:
            self.truncate_pending(0)
        keep = min(keep, len(ids))
        logits = self._run(ids, self.base_view, keep)
        if isinstance(ids, torch.Tensor):
            self._unread.append(ids.reshape(-1))
        else:
            self.tokens.extend(ids)
        return logits

    def extend_to(self, sequence: Sequence[int], keep: int = 1) -> torch.Tensor:
        """Make the committed tokens equal `sequence` (crop to the common prefix, forward the rest).

        At least `keep` trailing tokens are recomputed so their logits can be returned.
        """
        shared = min(common_prefix_length(self.tokens, sequence), len(sequence) - keep)
        self.truncate(shared)
        return self.forward(sequence[shared:], keep=keep)

    def forward_slim(self, ids: Sequence[int], view: ViewLike, keep: int = 1) -> torch.Tensor:
        """Process `ids` after the pending tokens with a sub-view (slim); they become pending.

        Pending entries written by a different sub-view are dropped first: each view's entries are
        only meaningful to that view.
        """
        view = as_view(view)
        if not ids or view is None:
            raise ValueError("forward_slim needs at least one token and a view")
        if self.pending and view != self.pending_view:
            self.truncate_pending(0)
        if self.pending and not self._stacks(view):
            raise ValueError("this view skips a layer the attention masks are sized from: it cannot stack")
        keep = min(keep, len(ids))
        logits = self._run(ids, view, keep)
        self.pending.extend(ids)
        self.pending_view = view
        return logits

    def extend_slim_to(self, sequence: Sequence[int], view: ViewLike, keep: int = 1) -> torch.Tensor:
        """Process `sequence` with the sub-view on top of the committed tokens; logits of the last `keep`.

        Committed tokens that disagree with `sequence` (rejected drafts the full view processed) are cropped;
        the sub-view never writes below the committed frontier. Pending tokens are reused as far as they
        agree with `sequence`.
        """
        view = as_view(view)
        if view is None:
            raise ValueError("extend_slim_to needs a view")
        shared = min(common_prefix_length(self.tokens, sequence), len(sequence) - keep)
        if shared < self.committed:
            self.truncate(shared)
        frontier = self.committed
        if view != self.pending_view or not self._stacks(view) or self.windowed:
            self.truncate_pending(0)
        tail = sequence[frontier:]
        reuse = min(common_prefix_length(self.pending, tail), len(tail) - keep)
        self.truncate_pending(reuse)
        return self.forward_slim(tail[reuse:], view, keep=keep)

    @property
    def length(self) -> int:
        """Positions held in the cache for layer 0 (committed plus pending)."""
        return self.committed + len(self.pending)
