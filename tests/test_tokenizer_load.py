"""models/tokenizer.py: the fast tokenizer load gives the very tokenizer AutoTokenizer gives, or is AutoTokenizer.

Fast tests build small tokenizer directories with the `tokenizers` library (a byte-level BPE whose file pipeline
differs from Qwen2Tokenizer's own, so the class's rebuild matters); the real test compares on the catalog's models.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from viasd.models.tokenizer import load_tokenizer

CORPUS = [
    "def merge(a, b):\n    return sorted(a + b)\n",
    "The quick brown fox jumps over the lazy dog. Café, naïve, Ångström.",
    "日本語のテキストと emoji 🤖🎉 mixed with ASCII text and numbers 12345.",
    "    indented lines\n\ttabs\r\nand trailing spaces   \n",
]
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PLAIN_ADDED = ("<tool_call>", "</tool_call>")
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "",
    " ",
    "hello world",
    "  leading and trailing  ",
    "\n\n\ttabs\r\nnew lines\n",
    "e\u0301 cafe\u0301 Å Å \ufb01",  # NFD and compatibility forms: Qwen2Tokenizer's NFC normalizer changes them
    "日本語のテキスト 🤖🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
    "x<|endoftext|>y <|im_end|><|im_end|>",
    "<tool_call>{}</tool_call> and <|not_a_token|>",
    "def f(x):\n    return x ** 2  # square\n",
]
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Write a haiku about caches, café."},
    {"role": "assistant", "content": "Lines stay warm\nhits return"},
    {"role": "user", "content": "<|im_end|> again"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ATTRIBUTES = (
    "eos_token",
    "bos_token",
    "pad_token",
    "unk_token",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "unk_token_id",
    "all_special_ids",
    "all_special_tokens",
    "special_tokens_map",
    "added_tokens_decoder",
    "model_max_length",
    "padding_side",
    "truncation_side",
    "add_bos_token",
    "add_eos_token",
    "chat_template",
    "vocab_size",
    "clean_up_tokenization_spaces",
    "split_special_tokens",
    "model_input_names",
    "name_or_path",
)


# ---------------------------------------------------------------------------------------------- comparison


def assert_same_tokenizer(
    fast: PreTrainedTokenizerBase,
    auto: PreTrainedTokenizerBase,
    texts: Sequence[str],
    conversations: Sequence[list[dict[str, str]]] = (CONVERSATION,),
) -> None:
    """Every property viasd relies on is equal: ids, text, special tokens, length, vocabulary, chat template."""
    assert type(fast) is type(auto)
    for name in ATTRIBUTES:
        assert getattr(fast, name, None) == getattr(auto, name, None), name
    assert len(fast) == len(auto)
    assert fast.init_kwargs == auto.init_kwargs  # what save_pretrained writes
    assert fast.get_vocab() == auto.get_vocab()
    everything = list(range(len(auto)))
    assert fast.convert_ids_to_tokens(everything) == auto.convert_ids_to_tokens(everything)
    for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert _state(fast.backend_tokenizer, part) == _state(auto.backend_tokenizer, part), part
    for text in texts:
        assert_same_text(fast, auto, text)
    for conversation in conversations:
        assert_same_chat(fast, auto, conversation)


def assert_same_text(fast: PreTrainedTokenizerBase, auto: PreTrainedTokenizerBase, text: str) -> None:
    """One text: encode and __call__ with and without special tokens, decode both ways."""
    for special in (True, False):
        ids = auto.encode(text, add_special_tokens=special)
        assert fast.encode(text, add_special_tokens=special) == ids, (text, special)
        called = auto(text, add_special_tokens=special)["input_ids"]
        assert fast(text, add_special_tokens=special)["input_ids"] == called, (text, special)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip), text


def assert_same_chat(
    fast: PreTrainedTokenizerBase, auto: PreTrainedTokenizerBase, conversation: list[dict[str, str]]
) -> None:
    """The chat template's text and ids, with and without a generation prompt, and with tools where it takes them."""
    if auto.chat_template is None:
        with pytest.raises(ValueError):
            fast.apply_chat_template(conversation, tokenize=False)
        return
    tool_sets = [None, TOOLS] if "tools" in str(auto.chat_template) else [None]
    for tools in tool_sets:
        for prompt in (True, False):
            options: dict[str, Any] = {"add_generation_prompt": prompt, "tools": tools}
            text = auto.apply_chat_template(conversation, tokenize=False, **options)
            assert fast.apply_chat_template(conversation, tokenize=False, **options) == text
            ids = auto.apply_chat_template(conversation, **options)
            assert fast.apply_chat_template(conversation, **options) == ids


def _state(backend: Tokenizer, part: str) -> Any:
    component = getattr(backend, part)
    return None if component is None else json.loads(component.__getstate__())


# ------------------------------------------------------------------------------------------ directories


def write_tiny_directory(
    directory: Path,
    config: dict[str, Any],
    *,
    model_type: str = "qwen2",
    template_file: str | None = None,
    specials_in_vocab: bool = False,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A tokenizer directory: `tiny_tokenizer`'s tokenizer.json (`edit` may alter it first), the tokenizer_config.json
    given, a config.json of `model_type` and, optionally, chat_template.jinja."""
    serialized = json.loads(tiny_tokenizer(specials_in_vocab).to_str())
    if edit is not None:
        edit(serialized)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(serialized, ensure_ascii=False, indent=2), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return directory


@functools.cache
def tiny_tokenizer(specials_in_vocab: bool = False) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, then SPECIAL as special and PLAIN_ADDED as plain added tokens; the special
    ones numbered past the model's vocabulary (as on the hub), or in it (as in files converted from GGUF)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    in_vocab = list(SPECIAL) if specials_in_vocab else []
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=alphabet, special_tokens=in_vocab)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in PLAIN_ADDED])
    return tokenizer


def qwen_config(**changes: Any) -> dict[str, Any]:
    """A tokenizer_config.json like Qwen2.5's, as transformers 5 saves it (no added_tokens_decoder), with `changes`;
    a change to `...` leaves that key out."""
    config: dict[str, Any] = {
        "add_prefix_space": None,
        "backend": "tokenizers",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": TEMPLATE,
    }
    config.update(changes)
    return {key: value for key, value in config.items() if value is not ...}


def added_tokens_decoder(contents: Sequence[str] = SPECIAL + PLAIN_ADDED) -> dict[str, dict[str, Any]]:
    """The config's form of the tiny tokenizer's added tokens (as older transformers saved it), those of `contents`."""
    added = tiny_tokenizer().get_added_tokens_decoder()
    return {str(index): token.__getstate__() for index, token in added.items() if token.content in contents}


def as_word_level(serialized: dict[str, Any]) -> None:
    """A word-level model in place of the BPE (Qwen2Tokenizer's rebuild would make a BPE of its vocabulary)."""
    vocab = serialized["model"]["vocab"]
    serialized["model"] = {"type": "WordLevel", "vocab": vocab, "unk_token": "<|endoftext|>"}


@pytest.fixture
def auto_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each AutoTokenizer.from_pretrained call (and still makes the tokenizer)."""
    calls: list[str] = []
    real = AutoTokenizer.from_pretrained

    def recorded(name: str, *args: Any, **kwargs: Any) -> PreTrainedTokenizerBase:
        calls.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorded)
    return calls


# ------------------------------------------------------------------------------------------ fast tests

FAST_CASES = {
    "qwen2-config-template": dict(config=qwen_config()),
    "qwen2-template-file": dict(config=qwen_config(chat_template=...), template_file=TEMPLATE),
    "qwen2-template-file-over-config": dict(config=qwen_config(chat_template="{{ messages }}"), template_file=TEMPLATE),
    "qwen2-added-tokens-decoder": dict(
        config=qwen_config(
            added_tokens_decoder=added_tokens_decoder(),
            additional_special_tokens=["<tool_call>"],
            bos_token="<|im_start|>",
            add_bos_token=True,  # dropped where a tokenizer.json says what is added
            padding_side="left",
            clean_up_tokenization_spaces=False,
            split_special_tokens=False,
        )
    ),
    "qwen2-defaults": dict(config=qwen_config(eos_token=..., pad_token=..., unk_token=..., bos_token=...)),
    "qwen2-fast-name": dict(config=qwen_config(tokenizer_class="Qwen2TokenizerFast")),
    "tokenizers-backend": dict(
        config=qwen_config(tokenizer_class="TokenizersBackend", bos_token="<|im_start|>", unk_token="<|endoftext|>"),
        model_type="llama",
    ),
    # Gemma's rebuild sets byte fallback, an unknown token and its own pipeline: put on the file's BPE here
    "gemma": dict(
        config=qwen_config(tokenizer_class="GemmaTokenizer", bos_token="<|im_start|>", unk_token="<|endoftext|>"),
        model_type="gemma",
        specials_in_vocab=True,
    ),
    "qwen2-specials-in-vocab": dict(config=qwen_config(), specials_in_vocab=True),
    "pretrained-fast": dict(config=qwen_config(tokenizer_class="PreTrainedTokenizerFast"), model_type="llama"),
}


@pytest.mark.parametrize("case", FAST_CASES)
def test_the_fast_load_is_autotokenizers_tokenizer_without_calling_it(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = write_tiny_directory(tmp_path / case, **FAST_CASES[case])
    auto = AutoTokenizer.from_pretrained(str(directory))

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fast load fell back to AutoTokenizer")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refused)
    fast = load_tokenizer(directory)
    assert_same_tokenizer(fast, auto, TEXTS + CORPUS)


def test_the_class_pipeline_replaces_the_files(tmp_path: Path) -> None:
    """Qwen2Tokenizer's NFC normalizer and split pre-tokenizer, not the file's bare byte level, as AutoTokenizer has."""
    fast = load_tokenizer(write_tiny_directory(tmp_path, qwen_config()))
    assert _state(fast.backend_tokenizer, "normalizer") == {"type": "NFC"}
    assert fast.encode("e\u0301") == fast.encode("\u00e9")


FALLBACK_CASES = {
    "no-tokenizer-json": dict(config=qwen_config()),
    "unknown-class": dict(
        config=qwen_config(tokenizer_class="GPT2Tokenizer", add_prefix_space=False), model_type="gpt2"
    ),
    "class-disagrees-with-model-type": dict(config=qwen_config(tokenizer_class="TokenizersBackend"), model_type="gpt2"),
    "not-bpe": dict(config=qwen_config(), edit=as_word_level),
    "remote-code": dict(config=qwen_config(auto_map={"AutoTokenizer": [None, "tok.Tok"]})),
    # Qwen2Tokenizer's rebuild keeps the config's added tokens, not the file's
    "config-lists-fewer-added-tokens": dict(config=qwen_config(added_tokens_decoder=added_tokens_decoder(SPECIAL))),
}


@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_other_directories_go_to_autotokenizer(case: str, tmp_path: Path, auto_calls: list[str]) -> None:
    directory = write_tiny_directory(tmp_path / case, **FALLBACK_CASES[case])
    if case == "no-tokenizer-json":
        _as_vocab_and_merges(directory)
    fast = load_tokenizer(directory)
    assert auto_calls == [str(directory)]
    assert_same_tokenizer(fast, AutoTokenizer.from_pretrained(str(directory)), TEXTS)


def test_added_token_ids_rust_renumbers_go_to_autotokenizer(tmp_path: Path, auto_calls: list[str]) -> None:
    """Added tokens past the vocabulary with a gap: Rust, like Qwen2Tokenizer's rebuild, numbers them on without it."""

    def gap(serialized: dict[str, Any]) -> None:
        for token in serialized["added_tokens"]:
            token["id"] += 3

    directory = write_tiny_directory(tmp_path, qwen_config(), edit=gap)
    fast = load_tokenizer(directory)
    assert auto_calls == [str(directory)]
    first = tiny_tokenizer().get_vocab_size(with_added_tokens=False)
    assert fast.convert_tokens_to_ids("<|endoftext|>") == first  # the rebuild's id, not the file's 3 later
    assert_same_tokenizer(fast, AutoTokenizer.from_pretrained(str(directory)), TEXTS)


def test_merges_read_with_another_subword_prefix_go_to_autotokenizer(tmp_path: Path, auto_calls: list[str]) -> None:
    """A BPE whose merges join "##" pieces: Qwen2Tokenizer's rebuild reads them without the prefix and fails."""
    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="##"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, continuing_subword_prefix="##"))
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(qwen_config()), encoding="utf-8")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}), encoding="utf-8")
    with pytest.raises(Exception, match="out of vocabulary"):
        load_tokenizer(tmp_path)
    assert auto_calls == [str(tmp_path)]


def test_a_broken_tokenizer_json_raises_autotokenizers_error(tmp_path: Path, auto_calls: list[str]) -> None:
    directory = write_tiny_directory(tmp_path, qwen_config())
    (directory / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [', encoding="utf-8")
    with pytest.raises(Exception) as fast_error:
        load_tokenizer(directory)
    assert auto_calls == [str(directory)]
    with pytest.raises(Exception) as auto_error:
        AutoTokenizer.from_pretrained(str(directory))
    assert type(fast_error.value) is type(auto_error.value)


def _as_vocab_and_merges(directory: Path) -> None:
    """Replace tokenizer.json by vocab.json and merges.txt, the files AutoTokenizer also reads for Qwen2Tokenizer."""
    serialized = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    (directory / "vocab.json").write_text(json.dumps(serialized["model"]["vocab"]), encoding="utf-8")
    merges = ["#version: 0.2", *(" ".join(pair) for pair in serialized["model"]["merges"])]
    (directory / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
    (directory / "tokenizer.json").unlink()


# ------------------------------------------------------------------------------------------ real models


@pytest.mark.real
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m"])
def test_the_catalogs_models_load_as_autotokenizer_loads_them(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from viasd.bench.tasks import load_specbench
    from viasd.models.fetch import ensure_default_model

    directory = ensure_default_model(name, progress=False)
    auto = AutoTokenizer.from_pretrained(str(directory))
    tasks = load_specbench()
    texts = [turn for task in tasks for turn in task.turns] + TEXTS
    conversations = [_conversation(task.turns) for task in tasks] + [CONVERSATION]

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{name}: the fast load fell back to AutoTokenizer")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refused)
    assert_same_tokenizer(load_tokenizer(directory), auto, texts, conversations)


def _conversation(turns: Sequence[str]) -> list[dict[str, str]]:
    """A bench task's turns as a chat: a system line, each turn as the user's with a short reply between."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for index, turn in enumerate(turns):
        if index:
            messages.append({"role": "assistant", "content": "Here is my answer."})
        messages.append({"role": "user", "content": turn})
    return messages


def test_a_directorys_vocabulary_fingerprint_is_remembered_until_its_files_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair check's vocabulary hash is read from the cache at the next start; a tokenizer.json changed in place
    gets the hash of what it holds now, and a tokenizer made in memory is hashed as before."""
    from viasd.models import loading

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    directory = write_tiny_directory(tmp_path / "tok", qwen_config())
    want = loading.vocabulary_fingerprint(load_tokenizer(directory))
    assert len(list((tmp_path / "cache" / "fingerprints").iterdir())) == 1
    again = load_tokenizer(directory)
    monkeypatch.setattr(again, "get_vocab", lambda: pytest.fail("hashed the vocabulary again"))
    assert loading.vocabulary_fingerprint(again) == want
    serialized = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = serialized["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped: another map
    (directory / "tokenizer.json").write_text(json.dumps(serialized, ensure_ascii=False), encoding="utf-8")
    changed = loading.vocabulary_fingerprint(load_tokenizer(directory))
    assert changed != want
    in_memory = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    assert loading.vocabulary_fingerprint(in_memory) == want  # the file's first map, hashed again
    assert len(list((tmp_path / "cache" / "fingerprints").iterdir())) == 2  # none for the one made in memory
