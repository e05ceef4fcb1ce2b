import pytest
from conftest import CORPUS
from transformers import AutoTokenizer

from pagedmoe.train.cli import main
from pagedmoe.train.data import REPO_ROOT, CorpusNotFoundError, read_splits, resolve_corpus
from pagedmoe.train.tokenizer import EOS_TOKEN, build_tokenizer

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n\nJULIET:\nAy me!\n"
CORPUS_FROM_REPO_ROOT = CORPUS.relative_to(REPO_ROOT).as_posix()
EXCERPT_BYTES = 55832  # tests/data/README.md


def test_tokenizer_loads_with_auto_tokenizer_and_round_trips(tmp_path):
    build_tokenizer(CORPUS_FROM_REPO_ROOT, tmp_path, vocab_size=2048)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == tokenizer.bos_token == EOS_TOKEN
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT
    _, held_out = read_splits(CORPUS)  # the tokenizer saw only the training split
    assert len(tokenizer(held_out)["input_ids"]) < len(held_out) / 2.5


def test_tokenizer_round_trips_arbitrary_bytes(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = "naïve café — 東京 🎭\ttabs"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_chat_template_renders_play_format(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "juliet", "content": "Where art thou?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, speaker="romeo")
    assert text == "JULIET:\nWhere art thou?\n\nROMEO:\n"
    assert tokenizer.apply_chat_template(messages, tokenize=True)


def test_corpus_resolves_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = resolve_corpus(CORPUS_FROM_REPO_ROOT)
    assert path == CORPUS
    assert path.stat().st_size == EXCERPT_BYTES


def test_split_is_first_ninety_percent_then_last_ten():
    train, val = read_splits(CORPUS_FROM_REPO_ROOT)
    full = CORPUS.read_text()
    assert train + val == full
    assert len(train) == int(len(full) * 0.9)


def test_missing_corpus_names_the_paths_tried_and_the_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CorpusNotFoundError) as error:
        resolve_corpus("no/such/corpus.txt")
    message = str(error.value)
    assert str(tmp_path.resolve() / "no/such/corpus.txt") in message
    assert str(REPO_ROOT / "no/such/corpus.txt") in message
    assert "--corpus PATH" in message


@pytest.mark.parametrize("command", ["tokenizer", "train"])
def test_cli_exits_with_the_message_when_the_corpus_is_missing(tmp_path, monkeypatch, tokenizer_dir, command):
    monkeypatch.chdir(tmp_path)
    flags = ["--tokenizer-dir", str(tokenizer_dir)] if command == "train" else []
    with pytest.raises(SystemExit, match=r"(?s)^error: corpus not found; tried:.*missing\.txt.*--corpus PATH"):
        main([command, "--corpus", "missing.txt", "--out-dir", str(tmp_path / "out"), *flags])


def test_bundled_models_carry_the_trainer_chat_template():
    """A retrained model renders tools as the bundled ones do: one template, pagedmoe/train/chat_template.jinja."""
    import json
    from pathlib import Path

    from pagedmoe.train.tokenizer import CHAT_TEMPLATE
    models = Path(__file__).resolve().parents[2] / "models"
    for name in ("pagedmoe-moe-default", "pagedmoe-draft-dense"):
        assert (models / name / "chat_template.jinja").read_text() == CHAT_TEMPLATE
        assert json.loads((models / name / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
