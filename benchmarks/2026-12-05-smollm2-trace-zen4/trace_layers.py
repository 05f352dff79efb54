"""smollm2-135m's gguf view on viasd's kernels against the kernels' torch references (VIASD_KERNELS=off), layer by
layer over one teacher-forced sequence: each decoder layer's output, the logits, and the first layers' Linear inputs
and outputs, as relative differences (norm of the difference over the reference's norm).

    python trace_layers.py
"""

import os

import torch

from viasd.models.loading import load_model
from viasd.passes.prepare import prepare
from viasd.passes.session import KVSession
from viasd.prompting import encode_prompt
from viasd.views.gguf import stored_view
from viasd.views.make import quantized_view

loaded = load_model("smollm2-135m", dtype="fp32")
prepare(loaded.model)
recipe, _ = stored_view("smollm2-135m", loaded.path)
view = quantized_view(loaded, recipe)
answer = " Bonjour! Comment allez-vous? Je suis ravi de vous rencontrer."
sequence = encode_prompt(loaded.tokenizer, "Say hello in French.") + loaded.tokenizer(answer)["input_ids"]


def traced(kernels: bool) -> tuple[dict, dict, torch.Tensor]:
    """Every decoder layer's output, every Linear's input and output, and the logits of one pass."""
    os.environ["VIASD_KERNELS"] = "on" if kernels else "off"
    layers, linears, hooks = {}, {}, []

    def keep_layer(index: int):
        def hook(module, inputs, output):
            layers[index] = (output[0] if isinstance(output, tuple) else output).detach().float().clone()

        return hook

    def keep_linear(name: str):
        def hook(module, inputs, output):
            linears[name] = (inputs[0].detach().float().clone(), output.detach().float().clone())

        return hook

    for index, layer in enumerate(loaded.model.model.layers):
        hooks.append(layer.register_forward_hook(keep_layer(index)))
    for name, module in view.linears.modules.items():
        hooks.append(module.register_forward_hook(keep_linear(name)))
    logits = KVSession(loaded.model, view).extend_to(sequence, keep=len(sequence)).float()
    for hook in hooks:
        hook.remove()
    return layers, linears, logits


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x - reference).norm() / reference.norm())


kernel_layers, kernel_linears, kernel_logits = traced(True)
reference_layers, reference_linears, reference_logits = traced(False)
for index in sorted(kernel_layers):
    print(f"layer {index:2d} output: {relative(kernel_layers[index], reference_layers[index]):.2e}")
print(f"logits: {relative(kernel_logits, reference_logits):.2e}")
for name in list(kernel_linears)[:14]:
    (x, y), (x_ref, y_ref) = kernel_linears[name], reference_linears[name]
    print(f"{name:40s} input {relative(x, x_ref):.2e}  output {relative(y, y_ref):.2e}")
