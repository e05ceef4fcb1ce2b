import os

from transformers import AutoTokenizer

from pagedmoe.train.data import read_splits, resolve_corpus
from pagedmoe.train.tokenizer import EOS_TOKEN, build_tokenizer

TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n\nJULIET:\nAy me!\n"


def test_tokenizer_loads_with_auto_tokenizer_and_round_trips(tmp_path):
    build_tokenizer("../shared/data/tinyshakespeare.txt", tmp_path, vocab_size=2048)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == tokenizer.bos_token == EOS_TOKEN
    ids = tokenizer(TEXT)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) < len(TEXT) / 2.5


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


def test_corpus_resolves_from_another_working_directory(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        path = resolve_corpus("../shared/data/tinyshakespeare.txt")
    finally:
        os.chdir(cwd)
    assert path.stat().st_size == 1115394


def test_split_is_first_ninety_percent_then_last_ten():
    train, val = read_splits("../shared/data/tinyshakespeare.txt")
    full = resolve_corpus("../shared/data/tinyshakespeare.txt").read_text()
    assert train + val == full
    assert len(train) == int(len(full) * 0.9)
