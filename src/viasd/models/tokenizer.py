"""A model directory's tokenizer, built the fast way where that is the very tokenizer AutoTokenizer would make.

AutoTokenizer parses tokenizer.json in Python (twice where tokenizer_config.json lists no added tokens) and, for
classes such as Qwen2Tokenizer, rebuilds the tokenizer from the vocabulary and merges it read; here Rust's
`tokenizers` parses the file once, inside the class AutoTokenizer picks, and the class's own normalizer, pre-tokenizer
and decoder are put on it, which is what that rebuild amounts to. Anything else falls back to AutoTokenizer.
Saving on the default target's directory (qwen2.5-coder-1.5b, best of 10 on a busy 2-core CPU): 0.64 s -> 0.30 s.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerBase

_log = logging.getLogger(__name__)

# Classes whose construction from tokenizer.json here is tested equal to AutoTokenizer's (tests/test_tokenizer_load.py).
_FAST_CLASSES = frozenset({"TokenizersBackend", "Qwen2Tokenizer", "GemmaTokenizer"})
# Files AutoTokenizer reads on paths this module does not reproduce: their presence sends a directory to it.
_OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "additional_chat_templates")
_BPE_SETTINGS = (
    "dropout",
    "unk_token",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "fuse_unk",
    "byte_fallback",
    "ignore_merges",
)
_ADDED_TOKENS_KEY = re.compile(rb'"added_tokens"\s*:\s*')


class _NotFast(Exception):
    """Why a directory's tokenizer goes to AutoTokenizer instead."""


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory, as `AutoTokenizer.from_pretrained(str(directory))` makes it, in less time
    where tokenizer.json and a class in `_FAST_CLASSES` allow (the fast way is an optimisation, never a change)."""
    try:
        return _fast_tokenizer(Path(directory))
    except Exception as why:  # any doubt: the reference path, whose errors are the user's to see
        _log.debug("tokenizer of %s: AutoTokenizer (%s: %s)", directory, type(why).__name__, why)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _fast_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The directory's tokenizer class built on tokenizer.json as Rust parses it; raises where that is not certain to
    equal AutoTokenizer's."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file() or any((directory / name).exists() for name in _OTHER_FILES):
        raise _NotFast("no tokenizer.json, or files only AutoTokenizer reads")
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    cls = _tokenizer_class(directory, config)
    file_tokens = _file_added_tokens(tokenizer_file)
    kwargs = _init_kwargs(directory, cls, config, file_tokens)
    tokenizer = cls(**kwargs)
    backend = tokenizer.backend_tokenizer
    # Rust numbers the file's added tokens as a rebuild numbers them (added in turn to the model's vocabulary), so
    # where each kept its id in the file, a rebuild keeps it too; where one did not, or they were misread: no.
    loaded = backend.get_added_tokens_decoder()
    if any(index not in loaded or loaded[index].content != token.content for index, token in file_tokens.items()):
        raise _NotFast("tokenizer.json's added tokens were misread or renumbered")
    if not _plain_class(cls):
        if _contents(kwargs["added_tokens_decoder"]) != _contents(file_tokens):  # a rebuild adds only these
            raise _NotFast("tokenizer_config.json lists other added tokens than tokenizer.json")
        _adopt_class_pipeline(backend, cls, kwargs)
    return tokenizer


def _contents(tokens: dict[int, AddedToken]) -> dict[int, str]:
    return {index: token.content for index, token in tokens.items()}


def _plain_class(cls: type) -> bool:
    """Whether `cls` takes tokenizer.json as it is (transformers' own test in `convert_to_native_format`)."""
    from transformers import TokenizersBackend

    return cls is TokenizersBackend or "__init__" not in cls.__dict__


def _tokenizer_class(directory: Path, config: dict[str, Any]) -> type:
    """The class AutoTokenizer picks for this directory, where it is one of `_FAST_CLASSES` and picked plainly (the
    config's class, agreeing with config.json's model type); raises otherwise."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        MODEL_IDS_TO_TOKENIZERS_BACKEND,
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    named = config.get("tokenizer_class")
    if not isinstance(named, str) or "auto_map" in config or config.get("fast_tokenizer_files"):
        raise _NotFast("no plain tokenizer_class")
    if any(fnmatch.fnmatch(str(directory).lower(), pattern) for pattern in MODEL_IDS_TO_TOKENIZERS_BACKEND):
        raise _NotFast("a directory AutoTokenizer treats by its name")
    model_type = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("model_type")
    registered = TOKENIZER_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    name = named.removesuffix("Fast")
    if registered is not None and registered.removesuffix("Fast") != name:
        raise _NotFast(f"{named} disagrees with model type {model_type}")
    cls = tokenizer_class_from_name(name) or tokenizer_class_from_name(name + "Fast")
    if cls is None or cls.__name__ == "PythonBackend":
        cls = TokenizersBackend
    if cls.__name__ not in _FAST_CLASSES:
        raise _NotFast(f"class {cls.__name__}")
    return cls


def _file_added_tokens(tokenizer_file: Path) -> dict[int, AddedToken]:
    """tokenizer.json's added tokens, read from the head of the file (where `tokenizers` writes them) without parsing
    the vocabulary; checked against the parsed file once it is built."""
    from tokenizers import AddedToken

    with tokenizer_file.open("rb") as handle:
        head = b""
        while chunk := handle.read(max(len(head), 1 << 16)):
            head += chunk
            found = _ADDED_TOKENS_KEY.search(head)
            if found is None:
                continue
            try:  # a character cut at the chunk's end is dropped; the array ends before it or the read goes on
                entries, _ = json.JSONDecoder().raw_decode(head[found.end() :].decode("utf-8", "ignore"))
            except json.JSONDecodeError:
                continue
            return {int(entry.pop("id")): AddedToken(**entry) for entry in entries}
    raise _NotFast("tokenizer.json has no added_tokens")


def _init_kwargs(
    directory: Path, cls: type, config: dict[str, Any], file_tokens: dict[int, AddedToken]
) -> dict[str, Any]:
    """The keyword arguments `from_pretrained` hands the class for this directory (transformers 5's
    `_from_pretrained`), with tokenizer.json passed as the file to parse."""
    from tokenizers import AddedToken

    kwargs = dict(config)
    kwargs.pop("tokenizer_class", None)
    if kwargs.pop("init_inputs", ()):
        raise _NotFast("init_inputs")
    kwargs.pop("add_bos_token", None)  # with a tokenizer.json, its post-processor says what is added
    kwargs.pop("add_eos_token", None)
    template = directory / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text(encoding="utf-8")
    if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    named = set(cls.SPECIAL_TOKENS_ATTRIBUTES)
    specific = {
        key: kwargs.pop(key)
        for key in list(kwargs)
        if key not in named and key.endswith("_token") and isinstance(kwargs[key], str | AddedToken)
    }
    if isinstance(kwargs.get("extra_special_tokens"), dict):
        specific.update(kwargs.pop("extra_special_tokens"))
    if specific:
        kwargs["model_specific_special_tokens"] = specific
    for argument, name in cls.vocab_files_names.items():
        kwargs[argument] = str(directory / name) if (directory / name).is_file() else None
    kwargs["tokenizer_file"] = str(directory / "tokenizer.json")
    kwargs.update(name_or_path=str(directory), is_local=True, local_files_only=False)
    decoder = _added_tokens_decoder(kwargs, file_tokens)
    kwargs["added_tokens_decoder"] = decoder
    kwargs = cls.convert_added_tokens(kwargs, save=False)
    by_content = {str(token): token for token in decoder.values()}
    for key in named:
        if kwargs.get(key) is not None and by_content:
            kwargs[key] = by_content.get(str(kwargs[key]), kwargs[key])
    return kwargs


def _added_tokens_decoder(kwargs: dict[str, Any], file_tokens: dict[int, AddedToken]) -> dict[int, AddedToken]:
    """The config's `added_tokens_decoder`, else tokenizer.json's added tokens (transformers' legacy path)."""
    from tokenizers import AddedToken

    listed = kwargs.get("added_tokens_decoder")
    if listed is None:
        return dict(file_tokens)
    decoder = {}
    for index, token in listed.items():
        if not isinstance(token, dict | AddedToken):
            raise _NotFast("a malformed added_tokens_decoder")  # AutoTokenizer raises its own error for it
        decoder[int(index)] = AddedToken(**token) if isinstance(token, dict) else token
    return decoder


def _adopt_class_pipeline(backend: Tokenizer, cls: type, kwargs: dict[str, Any]) -> None:
    """Put on `backend` (tokenizer.json as parsed) the BPE settings, normalizer, pre-tokenizer and decoder `cls`
    builds for itself, as AutoTokenizer's rebuild from the file's vocabulary and merges does; raises where that
    rebuild would make another model (not a BPE, or merges read with another subword prefix)."""
    ignored = {*cls.vocab_files_names, "tokenizer_file", "added_tokens_decoder", "name_or_path"}
    own = copy.deepcopy({key: value for key, value in kwargs.items() if key not in ignored})  # init edits tokens
    reference = cls(**own).backend_tokenizer
    if type(backend.model).__name__ != "BPE" or type(reference.model).__name__ != "BPE":
        raise _NotFast("not a BPE model")
    prefixes = (backend.model.continuing_subword_prefix, reference.model.continuing_subword_prefix)
    if len(prefixes[0] or "") != len(prefixes[1] or ""):  # the merges were read with its length: a setting no more
        raise _NotFast("a continuing_subword_prefix of another length than the class's")
    for name in _BPE_SETTINGS:
        if getattr(backend.model, name) != getattr(reference.model, name):
            setattr(backend.model, name, getattr(reference.model, name))
    backend.model._clear_cache()  # nothing is encoded yet; this only makes sure no word was merged the file's way
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        if _described(getattr(backend, part)) != _described(getattr(reference, part)):
            setattr(backend, part, getattr(reference, part))


def _described(component: Any) -> Any:
    """A tokenizer component (normalizer, pre-tokenizer, decoder) as comparable JSON; None stays None."""
    return None if component is None else json.loads(component.__getstate__())
