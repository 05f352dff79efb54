"""Plain autoregressive decoding of the target: the baseline every method is measured against."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder, decision_generator
from viasd.decode.output import OutputSink
from viasd.decode.round import Round
from viasd.decode.stats import GenerationStats
from viasd.passes.session import KVSession
from viasd.verify.resident import host_values
from viasd.verify.sampling import SamplingParams, adjusted, checked_token, pick, sample, warp_probs
from viasd.views.view import View


class PlainDecoder(Decoder):
    """One target forward pass per token."""

    method = "plain"

    def __init__(self, target: nn.Module, tokenizer: PreTrainedTokenizerBase, view: View | None = None) -> None:
        super().__init__(target, tokenizer, view)
        self.session = KVSession(target, view)

    def sessions(self) -> tuple[KVSession, ...]:
        return (self.session,)

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        generator = decision_generator(params, self.session.device)
        with stats.timed("verify"):
            raw = self.session.extend_to(prompt, keep=1)
            while True:
                logits = adjusted(raw, params, prompt + sink.tokens)
                if params.on_device(logits.device):  # picked where the logits are, read with one transfer
                    ((value,),) = host_values(pick(logits[-1:], params, generator))
                    token = checked_token(value)
                else:  # the host path of sampling on a CPU
                    token = sample(warp_probs(logits, params)[-1], generator)
                stats.record(Round([token], 0, full_kept=0), sink.push([token], raw))
                if sink.done:
                    break
                raw = self.session.forward([token], keep=1)
