"""A model as its GGUF file stores it: transformers' structure of its model, with no dense copy of its weights.

Every Linear layer's and the token embedding's weights stay in the file's blocks (mapped read-only, `GgufFile`); the
norms and biases, a few MB, are read into the model's dtype. Passes run the file's blocks through viasd's kernels (the
`gguf` view, views/gguf.py), the embedding looks its rows up block by block, and a draft head reads the output head's
rows it needs. Nothing makes the dense copy unless a pass asks for the model's own weights (the dense target:
`quant=none`, `via`, `hf-assisted`, a recipe quantized from dense weights): then it is made from the file, once per
layer, and one line says so (`densify` makes all of it at once, as those methods do when they are built).

The structure is viasd's own modules (models/network.py) for the families they build, else transformers' model
classes: either way its parameters are those of the model transformers would make from the file, in the same order,
so that a model fingerprint (models/fingerprint.py) is the same: profiles and draft heads made for the dense model fit
the stored one.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from viasd.errors import ViasdError
from viasd.models.gguf_file import GgufFile

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# Families whose structure is built from the file (checked against transformers' own reading of a file in the tests);
# any other family loads as its dense copy, as transformers reads it.
FAMILIES = frozenset({"qwen2", "llama", "qwen3"})
# Families whose conversion to GGUF interleaved the two halves of each query and key head's rotary dimensions.
PERMUTED = frozenset({"llama"})


@dataclass(eq=False)
class Source:
    """What the stored modules of one model share: the mapped file, the dtype the dense copy would have, and whether
    that copy's making was said yet (one line per model)."""

    file: GgufFile
    dtype: torch.dtype
    said: bool = field(default=False)
    fingerprint: str | None = None  # models/fingerprint.py, once computed (the weights never change)

    def say_dense(self, why: str) -> None:
        if not self.said:
            self.said = True
            print(f"{self.file.path.name}: making its dense {_dtype_name(self.dtype)} copy from the file ({why})",
                  file=sys.stderr)  # fmt: skip


@dataclass(frozen=True, eq=False)
class FileTensor:
    """One weight matrix in the file's blocks, rows in the model's order (`heads`: a query or key projection whose
    rows the conversion interleaved, put back per head)."""

    source: Source
    name: str
    heads: int | None = None

    @property
    def kind(self) -> str:
        return self.source.file.tensors[self.name].kind

    @property
    def shape(self) -> tuple[int, int]:
        rows, columns = self.source.file.tensors[self.name].shape[-2:]
        return int(rows), int(columns)

    def blocks(self) -> np.ndarray:
        """The raw blocks [rows, bytes per row] in the model's row order (a view of the mapping where no rows move)."""
        raw = self.source.file.blocks(self.name)
        return raw if self.heads is None else unpermuted(raw, self.heads)

    def rows(self, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows `ids` dequantized, float32 [len(ids), columns]; only their blocks are read."""
        import gguf

        index = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.heads is not None:
            index = unpermuted(np.arange(self.shape[0])[:, None], self.heads)[index, 0]
        raw = self.source.file.rows(self.name, index)
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(len(index), self.shape[1]))

    def dense(self) -> torch.Tensor:
        """The whole matrix dequantized, in the model's dtype (made a block of rows at a time: float32 never whole)."""
        rows, columns = self.shape
        out = torch.empty(rows, columns, dtype=self.source.dtype)
        step = max(1, (1 << 24) // columns)
        for begin in range(0, rows, step):
            out[begin : begin + step] = self.rows(np.arange(begin, min(rows, begin + step))).to(self.source.dtype)
        return out

    def sample(self, count: int = 64) -> torch.Tensor:
        """The fingerprint's sample (models/fingerprint.py): every (numel // count)-th weight, the first `count`,
        rounded to bf16 as the fingerprint rounds every weight."""
        rows, columns = self.shape
        flat = np.arange(0, rows * columns, max(1, rows * columns // count))[:count]
        wanted, where = np.unique(flat // columns, return_inverse=True)
        values = self.rows(wanted).to(torch.bfloat16).float()
        return values[torch.from_numpy(where), torch.from_numpy(flat % columns)]


def unpermuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query or key projection in the model's order, where the conversion to GGUF interleaved each head's
    halves of rotary dimensions: GGUF row 2j + h of a head is the model's row j + h * dim / 2."""
    per_head = rows.shape[0] // heads
    return np.asarray(rows).reshape(heads, per_head // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


class FileLinear(nn.Linear):
    """A Linear layer whose weight stays in the file's blocks. Views take the blocks (`file_tensor`); reading
    `weight` makes the layer's dense copy from the file, once (one line per model says so)."""

    def __init__(self, tensor: FileTensor, bias: torch.Tensor | None, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = tensor.shape
        self.file_tensor = tensor
        self.file_device = device
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.__dict__["_dense"] = None

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        if self.__dict__["_dense"] is None:
            self.file_tensor.source.say_dense("a pass runs its own weights")
            self.__dict__["_dense"] = nn.Parameter(self.file_tensor.dense().to(self.file_device), requires_grad=False)
        return self.__dict__["_dense"]

    def dense_module(self) -> nn.Linear:
        """A plain Linear layer with this layer's dense weight and bias (shared, not copied)."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = self.weight  # type: ignore[assignment]
        plain.bias = self.bias
        return plain


class BlockEmbedding(nn.Module):
    """The token embedding looked up in the file's blocks, row by row: a prompt of n tokens reads n rows' blocks.
    `scale` multiplies the rows as the model's own embedding does (Gemma's square root of the width)."""

    def __init__(self, tensor: FileTensor, device: torch.device, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = tensor.shape
        self.file_tensor = tensor
        self.file_device = device
        self.scale = scale
        self.__dict__["_dense"] = None

    @property
    def weight(self) -> torch.Tensor:
        if self.__dict__["_dense"] is None:
            self.file_tensor.source.say_dense("a pass reads the whole embedding")
            self.__dict__["_dense"] = nn.Parameter(self.file_tensor.dense().to(self.file_device), requires_grad=False)
        return self.__dict__["_dense"]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dtype = self.file_tensor.source.dtype
        if self.__dict__["_dense"] is not None:
            rows = self.__dict__["_dense"][input_ids]
        else:
            unique, inverse = torch.unique(input_ids.reshape(-1).cpu(), return_inverse=True)
            found = self.file_tensor.rows(unique.numpy()).to(dtype)
            rows = found[inverse].reshape(*input_ids.shape, self.embedding_dim).to(self.file_device)
        return rows if self.scale is None else rows * self.scale.to(dtype)

    def dense_module(self) -> nn.Module:
        plain = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta")
        plain.weight = self.weight  # type: ignore[assignment]
        return plain if self.scale is None else _Scaled(plain, self.scale)


class _Scaled(nn.Module):
    """An embedding whose rows are multiplied by a constant (Gemma's), for a densified model."""

    def __init__(self, embedding: nn.Embedding, scale: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.scale = embedding, scale

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids) * self.scale.to(self.inner.weight.dtype)


STORED = (FileLinear, BlockEmbedding)
_TAG = "viasd_stored"  # in a stored model's __dict__ until `densify` gives it its dense weights
_SOURCE = "viasd_source"  # in a stored model's __dict__ for good


def stored_source(model: nn.Module) -> Source | None:
    """The `Source` of a model built from its file's blocks (kept after `densify`: the weights are the same), else
    None."""
    return model.__dict__.get(_SOURCE)


def has_dense_weights(model: nn.Module) -> bool:
    """Whether a pass may read `model`'s own weights without making a dense copy (read per pass: one lookup)."""
    return _TAG not in model.__dict__


def is_stored(model: nn.Module) -> bool:
    """Whether some of `model`'s weights are still only in its file's blocks (no dense copy of them)."""
    return any(isinstance(module, STORED) and module.__dict__["_dense"] is None for module in model.modules())


def file_of(model: nn.Module) -> GgufFile | None:
    """The GGUF file a stored model's weights are read from (None: a model with its own dense weights)."""
    for module in model.modules():
        if isinstance(module, STORED):
            return module.file_tensor.source.file
    return None


def densify(model: nn.Module, why: str) -> bool:
    """Give every stored layer of `model` its dense weights from the file (one line says so), as plain torch modules;
    whether there was anything to make. Its bf16 layers take viasd's bf16 kernel, as a prepared model's do."""
    from viasd.kernels.bf16_linear import use_bf16_kernel

    stored = [(name, module) for name, module in model.named_modules() if isinstance(module, STORED)]
    if not stored:
        return False
    stored[0][1].file_tensor.source.say_dense(why)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()  # type: ignore[operator]
    tied = (
        isinstance(head, FileLinear)
        and isinstance(embedding, BlockEmbedding)
        and head.file_tensor.name == embedding.file_tensor.name
    )
    if tied:  # one matrix, as transformers ties it: the head shares the embedding's dense copy
        head.__dict__["_dense"] = embedding.weight
    missing = [module for _, module in stored if module.__dict__["_dense"] is None]
    # Dequantizing is numpy's work on large arrays, which releases the GIL: one layer per core at a time.
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for module, dense in zip(missing, pool.map(lambda m: m.file_tensor.dense(), missing), strict=True):
            module.__dict__["_dense"] = nn.Parameter(dense.to(module.file_device), requires_grad=False)
    owners = dict(model.named_modules())
    for name, module in stored:
        parent, _, child = name.rpartition(".")
        owners[parent]._modules[child] = module.dense_module()
    model.__dict__.pop(_TAG, None)
    use_bf16_kernel(model)
    return True


def output_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the model's output head [len(ids), hidden], in the model's dtype: from the file's blocks where
    the head is stored there (nothing else of it is read), else from its weight."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(head, FileLinear) and head.__dict__["_dense"] is None:
        return head.file_tensor.rows(ids.cpu().numpy()).to(head.file_tensor.source.dtype).to(head.file_device)
    return head.weight.detach()[ids.to(head.weight.device)]


# ---------------------------------------------------------------------------------------------------- building


def view_bytes(file: GgufFile) -> int:
    """About the memory a stored model takes once its view is made: every tensor in its format's layout (the table's,
    kernels/formats.py), but the token embedding where the file has an output head of its own (its rows are read from
    the file as asked)."""
    from viasd.kernels import formats

    separate_head = "output.weight" in file.tensors
    return int(
        sum(
            formats.view_bytes(tensor.kind, int(np.prod(tensor.shape)), tensor.nbytes)
            for name, tensor in file.tensors.items()
            if not (separate_head and name == "token_embd.weight")
        )
    )


def why_not_stored(file: GgufFile, device: str) -> str | None:
    """Why a GGUF file's model cannot run from its blocks here (None: it can)."""
    if torch.device(device).type != "cpu":
        return f"viasd's block kernels run on the CPU, not {device}"
    if file.architecture not in FAMILIES:
        return f"viasd does not build the {file.architecture or 'unnamed'} family from its file's blocks yet"
    return None


def build(file: GgufFile, config: PretrainedConfig, dtype: torch.dtype, device: str = "cpu") -> PreTrainedModel:
    """The model of `config` with its weights in `file`'s blocks (see the module's docstring); norms and biases read
    into `dtype`. A file that lacks a tensor the model needs, or has one of another shape, is refused in one line."""
    import gguf

    from viasd.models import network

    embedding = file.tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2 and embedding.shape[0] > config.vocab_size:
        # transformers counts the tokenizer's tokens; a file's embedding may have more rows (Qwen pads its heads to a
        # multiple of 256): the model's logits are the file's rows, as llama.cpp computes them.
        config.vocab_size = int(embedding.shape[0])
    if network.why_not(config) is None:  # viasd's own modules: no transformers model classes imported
        model: nn.Module = network.CausalLM(config, device="meta")
    else:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(file.architecture)
    layers = int(config.num_hidden_layers)
    if arch is None:
        raise ViasdError(f"{file.path.name}: gguf does not know the architecture {file.architecture!r}")
    names = gguf.get_tensor_name_map(arch, layers)
    source = Source(file, dtype)
    where = torch.device(device)
    heads = {"q_proj": file.number("attention.head_count"), "k_proj": file.number("attention.head_count_kv")}
    owners = dict(model.named_modules())
    for module_name, module in list(model.named_modules()):
        stored_name = names.get_name(module_name) if module_name else None
        if isinstance(module, nn.Linear):
            tensor_name = _weight_name(file, stored_name, module_name)
            permute = heads.get(module_name.rsplit(".", 1)[-1]) if file.architecture in PERMUTED else None
            tensor = FileTensor(source, tensor_name, permute)
            _check_shape(file, tensor, (module.out_features, module.in_features), module_name)
            bias = None if module.bias is None else _small(file, f"{stored_name}.bias", module.bias.shape, dtype, where)
            replacement: nn.Module = FileLinear(tensor, bias, where)
        elif isinstance(module, nn.Embedding):
            tensor = FileTensor(source, _weight_name(file, stored_name, module_name))
            _check_shape(file, tensor, tuple(module.weight.shape), module_name)  # type: ignore[arg-type]
            scale = getattr(module, "embed_scale", None)
            replacement = BlockEmbedding(tensor, where, None if scale is None else torch.as_tensor(scale).to(where))
        else:
            for key, parameter in list(module._parameters.items()):
                if parameter is not None and parameter.device.type == "meta":
                    value = _small(file, f"{stored_name}.{key}", parameter.shape, dtype, where)
                    module._parameters[key] = nn.Parameter(value, requires_grad=False)
            continue
        parent, _, child = module_name.rpartition(".")
        owners[parent]._modules[child] = replacement
    model.eval()
    model.__dict__[_TAG] = True
    model.__dict__[_SOURCE] = source
    return model


def _weight_name(file: GgufFile, stored_name: str | None, module_name: str) -> str:
    """The file's tensor holding a module's weight: its own, or for an output head without one (tied), the
    embedding's."""
    if stored_name is not None and f"{stored_name}.weight" in file.tensors:
        return f"{stored_name}.weight"
    if stored_name == "output" and "token_embd.weight" in file.tensors:
        return "token_embd.weight"
    raise ViasdError(f"{file.path.name} has no tensor for {module_name} (looked for {stored_name}.weight)")


def _check_shape(file: GgufFile, tensor: FileTensor, shape: tuple[int, ...], module_name: str) -> None:
    if tensor.shape != tuple(shape):
        raise ViasdError(
            f"{file.path.name}: tensor {tensor.name} is {tensor.shape[0]} x {tensor.shape[1]}, where its config's "
            f"{module_name} is {shape[0]} x {shape[1]}"
        )


def _small(file: GgufFile, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A norm's or bias's values (stored as floats) in `dtype`."""
    import gguf

    info = file.tensors.get(name)
    if info is None:
        raise ViasdError(f"{file.path.name} has no tensor {name}")
    values = gguf.quants.dequantize(np.asarray(file.blocks(name)).reshape(-1), gguf.GGMLQuantizationType[info.kind])
    found = torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1))
    if found.numel() != int(np.prod(tuple(shape))):
        wanted = tuple(shape)
        raise ViasdError(f"{file.path.name}: tensor {name} has {found.numel()} values, where its config wants {wanted}")
    return found.reshape(shape).to(dtype).to(device)


def weight_device(linear: nn.Module) -> torch.device:
    """Where a Linear layer's weight is (or would be, for a stored one), without making a dense copy."""
    return linear.file_device if isinstance(linear, STORED) else linear.weight.device  # type: ignore[return-value]


def weight_dtype(linear: nn.Module) -> torch.dtype:
    """A Linear layer's weight dtype (a stored one's dense copy's), without making a dense copy."""
    return linear.file_tensor.source.dtype if isinstance(linear, STORED) else linear.weight.dtype  # type: ignore[return-value]


def dense_copy(linear: FileLinear) -> nn.Linear:
    """A temporary plain Linear layer with the stored layer's dense weight, for making a quantized copy of it: the
    stored layer keeps no dense weight afterwards."""
    plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    plain.weight = nn.Parameter(linear.file_tensor.dense().to(linear.file_device), requires_grad=False)
    plain.bias = linear.bias
    return plain


class OutputRows:
    """A model's output head as rows read on demand ([V, hidden] by `shape`; `rows[ids]`): a stored head's from the
    file's blocks, only the rows asked for, a dense head's from its weight."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        head = model.get_output_embeddings()  # type: ignore[operator]
        self.shape = (int(head.out_features), int(head.in_features))
        self.device = weight_device(head)
        self.dtype = weight_dtype(head)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return output_rows(self.model, torch.as_tensor(ids, dtype=torch.long))


def embedding_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding's matrix (unscaled, as its `weight` holds them): a stored one's from its blocks."""
    if isinstance(embedding, BlockEmbedding) and embedding.__dict__["_dense"] is None:
        found = embedding.file_tensor.rows(ids.cpu().numpy()).to(embedding.file_tensor.source.dtype)
        return found.to(embedding.file_device)
    return embedding.weight.detach()[ids]


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes in: its embedding's (a stored one's dense copy's), read without making it."""
    return weight_dtype(model.get_input_embeddings())  # type: ignore[operator]
