"""Byte-level BPE tokenizer trained with HF `tokenizers`, saved so `AutoTokenizer` loads it."""

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedmoe.train.data import read_splits

EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SPECIAL_TOKENS = [EOS_TOKEN, "<|pad|>"]
# "ROLE:\ncontent\n\n" per message; tools, assistant tool_calls and tool messages in the Hermes style
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()


def train_bpe(text: str, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def wrap_for_transformers(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def make_config_portable(out_dir: Path) -> None:
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_tokenizer(corpus: str, out_dir: str | Path, vocab_size: int = 2048, fraction: float = 1.0) -> Path:
    train_text, _ = read_splits(corpus, fraction)
    wrapped = wrap_for_transformers(train_bpe(train_text, vocab_size))
    wrapped.save_pretrained(str(out_dir))
    make_config_portable(Path(out_dir))
    return Path(out_dir)


def load_tokenizer(path: str | Path):
    return AutoTokenizer.from_pretrained(str(path))


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> Path:
    for name in TOKENIZER_FILES:
        if Path(src_dir, name).resolve() != Path(dst_dir, name).resolve():
            shutil.copyfile(Path(src_dir, name), Path(dst_dir, name))
    return Path(dst_dir)
