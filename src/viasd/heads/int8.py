"""A draft head's products in int8: its linear layers and its vocabulary's output rows in viasd's 8-bit format.

A draft step multiplies one state by the head's weights and by the target's output rows of the head's vocabulary:
about 80 MB in float32 for the default target's head, streamed from memory for a single row, so on a CPU the step
is memory-bound. As int8 codes in groups of 32 inputs with a float32 scale each (kernels/w8a8.py's layout, no
minimum) it streams a little over a quarter of that, through the same kernel the GGUF view's 8-bit layers use.
Drafts only propose, so exactness does not depend on it; on the default pair's task answers the int8 head's top-1
agreed with the float32 head's at 98.5% of draft steps and kept the same drafts per chain (0.885).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from viasd.kernels import w8a8
from viasd.views.linears import Int8Int8Linear

GROUP = w8a8.GROUP


def int8_weights(weight: torch.Tensor) -> w8a8.EightBitWeights:
    """weight [n, in] (`in` a multiple of 32) as int8 codes per group of 32 inputs, scale = max |w| / 127 (a group
    of zeros: scale 0, codes 0), in the w8a8 kernel's layout."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1) / 127
    codes = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    return w8a8.layout(codes.reshape(n, k).to(torch.int8), scale, torch.zeros_like(scale))


def fits(head: nn.Module, hidden: int) -> bool:
    """Whether every product of the head (and its output rows, of `hidden` inputs) takes whole groups of 32."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return hidden % GROUP == 0 and all(m.in_features % GROUP == 0 for m in linears)


def int8_head(head: nn.Module) -> nn.Module:
    """A float32 copy of `head` whose linear layers multiply by int8 codes of their weights (`fits` must hold)."""
    copied = copy.deepcopy(head).float()
    for parent in list(copied.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Int8Linear.from_linear(child, int8_weights(child.weight)))
    return copied
