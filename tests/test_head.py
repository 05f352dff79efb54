"""The draft head: drafting from the target's features is exact (greedy tokens, sampling law), its features are
the target's, its files and training runs survive faults, and the whole pipeline (data, training, file, drafting)
runs on a tiny chat model."""

from __future__ import annotations

import pytest
import torch

from helpers import Recording
from laws import ALPHA, exact_joint, pooled_pvalue
from test_drafts import SAMPLING, sample_counts
from tiny import ARCHITECTURES, tiny_chat_tokenizer, tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.head import HeadDrafter
from viasd.drafters.hybrid import HybridDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import ViasdError
from viasd.heads.file import load_head, save_head
from viasd.heads.find import find_head
from viasd.heads.network import DraftHead, HeadConfig
from viasd.models.fingerprint import model_fingerprint
from viasd.training.conversations import write_conversations
from viasd.training.dataset import DataFolder
from viasd.training.prompts import Opener
from viasd.training.train import Checkpoint, TrainSettings, train
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 9, 12, 3, 4, 5]


def random_head(hidden: int, vocab: int, seed: int = 0, scale: float = 0.05, dtype=torch.float64) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig(hidden=hidden, width=32, vocab=vocab), torch.arange(vocab)).to(dtype)
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=scale)
    return head


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_with_a_draft_head_equals_plain(arch):
    """sd, the lookup+head hybrid and via-exact with a head's drafts give plain greedy's tokens (a head that drafts
    from the target's own features, on viasd's loop for llama/qwen2 and on the model's own forward for gemma)."""
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    head = random_head(64, 64)
    sd = SpeculativeDecoder(target, tok, Recording(HeadDrafter(head, target)), gamma=5).generate(PROMPT, config)
    assert sd.tokens == plain
    assert sd.stats.sources["head"].drafted > 40  # it drafted in (nearly) every round, not only the first
    both = HybridDrafter(PromptLookupDrafter(3, 2), HeadDrafter(head, target), 0.0)
    hybrid = SpeculativeDecoder(target, tok, both, gamma=5, stop=0.3).generate(PROMPT, config)
    assert hybrid.tokens == plain and set(hybrid.stats.sources) == {"lookup", "head"}
    exact = RoundPolicy(Gate.exact(), gamma=4)
    masks = [LayerMask.skipping(4, [2])]
    via = TieredDecoder(target, tok, HeadDrafter(head, target), masks, exact).generate(PROMPT, config)
    assert via.tokens == plain


def test_a_head_drafts_from_the_targets_own_features():
    """Every feature the session kept equals the final hidden state of a fresh forward pass over its tokens (the
    head's inputs are the target's, position for position, after rounds that rejected drafts)."""
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    drafter = HeadDrafter(random_head(64, 64), target)
    decoder = SpeculativeDecoder(target, tok, drafter, gamma=4)
    decoder.generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    session = decoder.session
    tokens = session.tokens
    with torch.inference_mode():
        fresh = target.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
    known = [p for p in range(len(tokens)) if p < session.features.known and session.features.have[p]]
    assert len(known) > 20
    for position in known:
        torch.testing.assert_close(session.features.row(position), fresh[position], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampling_with_a_draft_head_follows_the_target_distribution(params):
    """Chi-square against the exact law of the warped target (false-alarm rate ALPHA per test)."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    head = random_head(64, 5, seed=3, scale=0.3)  # a vocabulary of 5 of the 6 tokens: p is 0 on the last one
    recording = Recording(HeadDrafter(head, target))
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), recording, gamma=2)
    counts, stats = sample_counts(decoder, [2, 3, 4, 2], params, length, n)
    drafted = sum(s.sources["head"].evaluated for s in stats if "head" in s.sources)
    kept = sum(s.sources["head"].accepted for s in stats if "head" in s.sources)
    assert n // 10 < kept < drafted - n // 10, (kept, drafted)  # drafts were kept and rejected, often
    assert pooled_pvalue(exact_joint(target, [2, 3, 4, 2], params, vocab, length), counts, n) > ALPHA


# ------------------------------------------------------------------------------------------------ head files


def test_head_files_round_trip_and_refuse_damage_and_other_targets(tmp_path):
    target = tiny_model("qwen2")
    head = random_head(64, 64, dtype=torch.float32)
    path = tmp_path / "head.safetensors"
    save_head(path, head, model_fingerprint(target), "vocab", {"steps": 3})
    loaded = find_head(target, path)
    assert loaded.training == {"steps": 3}
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.head.state_dict()[name].float(), tensor.to(torch.bfloat16).float())
    with pytest.raises(ViasdError, match="trained for another target"):
        find_head(tiny_model("qwen2", seed=7), path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a weight's byte: the file still parses
    (tmp_path / "flipped.safetensors").write_bytes(bytes(data))
    with pytest.raises(ViasdError, match="damaged"):
        load_head(tmp_path / "flipped.safetensors")
    (tmp_path / "short.safetensors").write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ViasdError, match="cannot be read"):
        load_head(tmp_path / "short.safetensors")
    (tmp_path / "other.safetensors").write_bytes(b"not a head")
    with pytest.raises(ViasdError):
        load_head(tmp_path / "other.safetensors")
    with pytest.raises(ViasdError, match="no draft head"):
        load_head(tmp_path / "missing.safetensors")


def with_metadata(path, out, **fields) -> None:
    """`path`'s head file with some metadata fields replaced (the digest covers the tensors, not the metadata)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as opened:
        metadata = {**(opened.metadata() or {}), **fields}
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    save_file(tensors, out, metadata=metadata)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ("null", "its config is null, not a JSON object"),
        ("[1, 2]", "its config is a list, not a JSON object"),
        ('"chain"', "its config is a string, not a JSON object"),
        ("{not json", "its config is not JSON"),
        ('{"hidden": 64, "width": 32, "vocab": 64, "design": "tree"}', "unknown design 'tree'"),
        ('{"width": 32, "vocab": 64}', "does not give the head's hidden size"),
        ('{"hidden": "64", "width": 32, "vocab": 64}', 'hidden is "64", not a positive integer'),
        ('{"hidden": 64, "width": -1, "vocab": 64}', "width is -1, not a positive integer"),
        ('{"hidden": 64, "width": true, "vocab": 64}', "width is true, not a positive integer"),
        ('{"hidden": 64, "width": 32, "vocab": 64, "depth": 3}', "fields no chain head has (depth)"),
        ('{"hidden": 64, "width": 1099511627776, "vocab": 64}', "its config does not fit its tensors"),
        ('{"hidden": 64, "heads": 3, "kv_heads": 2, "design": "attention"}', "not a multiple of its kv_heads"),
    ],
)
def test_a_head_file_whose_config_is_not_a_heads_is_refused_in_one_line(tmp_path, capsys, monkeypatch, config, why):
    """The metadata is not under the digest: a damaged or hand-edited config gave a traceback. It is one line, and a
    method that drafts with the head drafts with the next-best drafter instead."""
    from test_auto import engine

    path, edited = tmp_path / "head.safetensors", tmp_path / "edited.safetensors"
    built = engine()
    save_head(path, random_head(64, 64, dtype=torch.float32), model_fingerprint(built.target.model), "v", {})
    with_metadata(path, edited, config=config)
    with pytest.raises(ViasdError) as refused:
        load_head(edited)
    message = str(refused.value)
    assert why in message and "\n" not in message and message.endswith("train it again"), message
    decoder = built.decoder(f"sd:drafter=head:head={edited}")
    assert decoder.drafter.name == "model"  # the next-best drafter
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and why in lines[0] and "next-best drafter" in lines[0], lines


def test_a_head_file_s_other_fields_and_a_folder_named_as_a_head(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "head.safetensors"
    save_head(path, random_head(64, 64, dtype=torch.float32), "t", "v", {"steps": 3})
    for training in ("null", "[1]", "{broken"):  # how the head was trained only informs: left out, never a failure
        with_metadata(path, tmp_path / "edited.safetensors", training=training)
        assert load_head(tmp_path / "edited.safetensors").training == {}
    with pytest.raises(ViasdError, match=r"is a folder, not a draft head: name the head's \.safetensors file$"):
        load_head(tmp_path)
    save_file({"token_ids": torch.arange(4)}, tmp_path / "bare.safetensors")
    with pytest.raises(ViasdError, match="is not a viasd draft head"):
        load_head(tmp_path / "bare.safetensors")


def test_a_method_without_a_head_drafts_with_the_next_best_drafter_and_says_so(capsys, monkeypatch, tmp_path):
    from test_auto import engine

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    built = engine()
    decoder = built.decoder("sd:drafter=head")
    assert decoder.drafter.name == "model"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no draft head for this target" in lines[0] and "next-best" in lines[0]


# ------------------------------------------------------------------------------------ data and training, end to end


def borrowed(target):
    """What a head borrows from its target: the embeddings and the output head's weights."""
    return target.get_input_embeddings().weight.detach().float(), target.get_output_embeddings().weight.detach().float()


def tiny_data(tmp_path, conversations: int = 48):
    """Conversations a tiny chat model writes itself, in a data folder."""
    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64, init_scale=0.3)
    folder = DataFolder(tmp_path / "data", {"test": 1})
    written = write_conversations(
        target, tok, None, lambda i: Opener("hello", False), 0, rows=8, max_request=6, max_answer=24
    )
    shard = []
    for conversation in written:
        shard.append(conversation)
        if len(shard) == 16:
            folder.save(shard)
            shard = []
            if folder.conversations() >= conversations:
                break
    return target, tok, folder


def test_written_conversations_hold_the_targets_greedy_answers_and_features(tmp_path):
    target, _, folder = tiny_data(tmp_path, 16)
    data = folder.load()
    assert data.conversations == 16
    first = data.tokens[: int(data.starts[1])].tolist()
    answer_from = int(torch.nonzero(data.answer[: int(data.starts[1])])[0])
    with torch.inference_mode():
        out = target(input_ids=torch.tensor([first]), output_hidden_states=True)
    # The answer is the target's greedy continuation, and each feature is its final hidden state there.
    assert first[answer_from:] == out.logits[0, answer_from - 1 : -1].argmax(-1).tolist()[: len(first) - answer_from]
    rows = (data.feature_at < int(data.starts[1])).nonzero()[:, 0]
    assert len(rows) >= len(first) - answer_from
    for row in rows.tolist():
        position = int(data.feature_at[row])
        expected = out.hidden_states[-1][0, position].to(torch.bfloat16).float()
        torch.testing.assert_close(data.features[row].float(), expected)


def test_training_passes_are_the_routes_batched_legs_and_a_model_the_loop_does_not_run_is_refused():
    """Training asks the route for its conversations' ragged passes (a batcher's segments, the head's features kept):
    a model whose passes viasd's loop does not run (an architecture it does not cover) is refused in one line, not
    run by a loop that does not compute it."""
    tok = tiny_chat_tokenizer(320)
    target = tiny_model("gemma", vocab_size=320, hidden=64)
    written = write_conversations(target, tok, None, lambda i: Opener("hello", False), 0, rows=2, max_request=4)
    with pytest.raises(ViasdError, match="ragged passes, which do not run this model here"):
        next(written)


def test_a_trained_head_drafts_better_than_an_untrained_one_and_stays_exact(tmp_path):
    # 96 conversations: the last 5% (held out) are then 4, enough that one odd answer does not decide the test.
    target, tok, folder = tiny_data(tmp_path, 96)
    data = folder.load()
    weights = borrowed(target)
    settings = TrainSettings(width=64, vocab=320, depth=3, batch=32, lr=3e-3, steps=300, seconds=600)
    head, measured = train(
        data, *weights, settings, Checkpoint(tmp_path / "ckpt.pt"), {2}, progress=False, log=lambda _: None
    )
    untrained = TrainSettings(width=64, vocab=320, depth=3, batch=32, lr=0.0, steps=1, seconds=600)
    _, before = train(
        data, *weights, untrained, Checkpoint(tmp_path / "ckpt0.pt"), {2}, progress=False, log=lambda _: None
    )
    # Top-1 accuracy over the unrolled steps, on conversations never trained on (an untrained head: about 1%).
    mean = sum(measured["accuracy"]) / len(measured["accuracy"])
    assert mean > sum(before["accuracy"]) / len(before["accuracy"]) + 0.05, (measured, before)
    assert measured["accepted_per_chain"] > before["accepted_per_chain"], (measured, before)
    # Drafting with it: the target's greedy tokens, and drafts kept.
    prompt = data.tokens[: int(torch.nonzero(data.answer)[0])].tolist()
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(prompt, config).tokens
    out = SpeculativeDecoder(target, tok, HeadDrafter(head.double(), target), gamma=4).generate(prompt, config)
    assert out.tokens == plain and out.stats.sources["head"].accepted > 0


def test_training_in_bf16_products_learns_as_well_as_in_float32(tmp_path):
    # What a CPU with native bf16 trains in (train.products_dtype): the same steps from the same start must reach
    # the same held-out accuracy, within what one rounding-sized difference in a few answers moves.
    target, _, folder = tiny_data(tmp_path, 96)
    data = folder.load()
    weights = borrowed(target)
    settings = TrainSettings(width=64, vocab=320, depth=3, batch=32, lr=3e-3, steps=300, seconds=600)
    measured = {}
    for dtype in (torch.float32, torch.bfloat16):
        checkpoint = Checkpoint(tmp_path / f"{dtype}.pt")
        _, measured[dtype] = train(
            data, *weights, settings, checkpoint, {2}, progress=False, log=lambda _: None, dtype=dtype
        )
    mean = {dtype: sum(m["accuracy"]) / len(m["accuracy"]) for dtype, m in measured.items()}
    assert mean[torch.float32] > 0.1, measured  # it learned (an untrained head: about 1%)
    assert abs(mean[torch.bfloat16] - mean[torch.float32]) < 0.03, measured


def test_training_resumes_where_it_stopped_and_refuses_what_it_cannot_resume(tmp_path):
    target, _, folder = tiny_data(tmp_path, 16)
    data = folder.load()
    weights = borrowed(target)
    checkpoint = Checkpoint(tmp_path / "ckpt.pt")
    quiet = {"progress": False, "log": lambda _: None}
    settings = TrainSettings(width=32, vocab=64, depth=2, batch=8, steps=5, seconds=600)
    _, first = train(data, *weights, settings, checkpoint, {2}, **quiet)
    _, second = train(data, *weights, TrainSettings(**{**settings.to_dict(), "steps": 12}), checkpoint, {2}, **quiet)
    assert (first["steps"], second["steps"]) == (5, 12)  # went on from step 5, not from 0
    with pytest.raises(ViasdError, match="other settings"):
        train(data, *weights, TrainSettings(**{**settings.to_dict(), "width": 16}), checkpoint, {2}, **quiet)
    checkpoint.path.write_bytes(checkpoint.path.read_bytes()[:100])
    with pytest.raises(ViasdError, match="cannot be read"):
        train(data, *weights, settings, checkpoint, {2}, **quiet)


def test_a_data_folder_refuses_other_settings_and_damaged_shards(tmp_path):
    _, _, folder = tiny_data(tmp_path, 16)
    with pytest.raises(ViasdError, match="other settings"):
        DataFolder(folder.path, {"test": 2})
    shard = folder.shards()[0]
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(ViasdError, match="damaged"):
        folder.load()


def test_auto_probes_the_head_where_the_target_has_one(monkeypatch, tmp_path):
    from test_auto import engine
    from viasd import auto
    from viasd.heads.find import trained_head_path

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "PROBE_PROMPTS", ("t3 t4 t5", "t9 t8 t7 t6"))
    without = engine().decoder("auto").choice["tokens_per_second"]
    assert not any("head" in name for name in without)
    built = engine()
    fingerprint = model_fingerprint(built.target.model)
    save_head(trained_head_path(fingerprint), random_head(64, 64, dtype=torch.float32), fingerprint, "v", {})
    record = built.decoder("auto").choice  # another candidate list: probed again, not read from the cache
    assert {"sd:drafter=head", "sd:drafter=lookup+head"} <= set(record["tokens_per_second"])


def test_train_drafter_writes_data_then_a_head_and_resumes(tmp_path, monkeypatch):
    """The command end to end on a tiny chat model: data, then a head in the cache that sd:drafter=head finds; a
    second run with a larger budget goes on from the checkpoint; bad options are one line."""
    from typer.testing import CliRunner

    from viasd.cli import app
    from viasd.heads.find import trained_head_path
    from viasd.models.loading import LoadedModel

    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64, dtype=torch.float32)
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("viasd.engine.load_model", lambda name, **_: LoadedModel(target, tok, name, name))
    args = ["train-drafter", "--target", "tiny", "--width", "32", "--vocab", "64", "--depth", "2", "--rows", "4"]
    args += ["--tokens", "300", "--no-progress"]
    first = CliRunner().invoke(app, [*args, "--train-minutes", "0.02"])
    assert first.exit_code == 0, first.output
    path = trained_head_path(model_fingerprint(target))
    assert path.exists() and "draft head written" in first.output
    steps = load_head(path).training["steps"]
    again = CliRunner().invoke(app, [*args, "--train-minutes", "0.04"])
    assert again.exit_code == 0, again.output
    assert load_head(path).training["steps"] > steps  # went on from the checkpoint
    assert find_head(target).digest == load_head(path).digest
    bad = CliRunner().invoke(app, [*args, "--width", "0"])  # the last --width counts
    assert bad.exit_code == 2 and "--width must be >= 1" in bad.output


def test_requests_from_a_list_are_each_answered_once_and_the_writer_stops(tmp_path):
    """write_data with `source`: one conversation per request, the last shard partial, nothing more on a rerun."""
    from viasd.training.writing import write_data

    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64, init_scale=0.3)
    folder = DataFolder(tmp_path / "tasks", {"test": 1})
    requests = [Opener(f"task {i} " + "word " * (3 * i), True) for i in range(19)]  # 16 + 3: one partial shard
    held = write_data(target, tok, None, folder, 600, 1 << 62, 4, 0, 6, 12, False, source=requests)
    data = folder.load()
    assert data.conversations == 19 and held == len(data.tokens)
    assert write_data(target, tok, None, folder, 600, 1 << 62, 4, 0, 6, 12, False, source=requests) == held
    bounds = zip(data.starts[:-1].tolist(), data.starts[1:].tolist(), strict=True)
    texts = [tok.decode(data.tokens[a:b].tolist()) for a, b in bounds]
    for i in range(19):  # each request's text is in exactly one conversation
        assert sum(f"task {i} " in text for text in texts) == 1


def test_joined_training_sets_keep_each_conversation_and_its_features(tmp_path):
    from viasd.training.dataset import joined

    _, _, folder = tiny_data(tmp_path, 16)
    data = folder.load()
    both = joined([data, data])
    n = len(data.tokens)
    assert both.conversations == 2 * data.conversations and len(both.tokens) == 2 * n
    assert torch.equal(both.tokens[n:], data.tokens) and torch.equal(both.starts[-1:], data.starts[-1:] + n)
    assert torch.equal(both.feature_at[len(data.feature_at) :], data.feature_at + n)
    assert torch.equal(both.features[len(data.features) :], data.features)


def test_task_requests_come_from_the_calibration_split_only():
    from viasd.bench.splits import split_of
    from viasd.bench.tasks import build_tasks
    from viasd.training.prompts import task_openers

    requests = {opener.text for opener in task_openers()}
    every = build_tasks(count=None, humaneval=164, split="all")
    assert requests == {task.turns[0] for task in every if split_of(task.key) == "calibration"}
    assert not requests & {task.turns[0] for task in every if split_of(task.key) == "report"}


def test_train_drafter_with_tasks_answers_them_first_and_trains_on_both(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from viasd.cli import app
    from viasd.heads.find import trained_head_path
    from viasd.models.loading import LoadedModel
    from viasd.training.command import TASK_WEIGHT

    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64, dtype=torch.float32)
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("viasd.engine.load_model", lambda name, **_: LoadedModel(target, tok, name, name))
    monkeypatch.setattr("viasd.training.prompts.task_openers", lambda: [Opener(f"task {i}", True) for i in range(5)])
    args = ["train-drafter", "--target", "tiny", "--width", "32", "--vocab", "64", "--depth", "2", "--rows", "4"]
    result = CliRunner().invoke(app, [*args, "--tokens", "200", "--no-progress", "--tasks", "--train-minutes", "0.02"])
    assert result.exit_code == 0, result.output
    assert "calibration tasks: 5 of 5 answered" in result.output
    training = load_head(trained_head_path(model_fingerprint(target))).training
    from safetensors.torch import load_file

    own = sorted((tmp_path / "heads" / model_fingerprint(target) / "data").glob("shard-*.safetensors"))
    own_conversations = sum(len(load_file(shard)["answer_from"]) for shard in own)
    assert own and training["conversations"] == own_conversations + TASK_WEIGHT * 5
