"""Corpus access: locate the shared corpus, split it 90/10, tokenize, and cut training windows."""

from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_FRACTION = 0.9


class CorpusNotFoundError(FileNotFoundError):
    pass


def resolve_corpus(path: str | Path) -> Path:
    path = Path(path).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise CorpusNotFoundError(missing_corpus_message(candidates))


def missing_corpus_message(candidates: list[Path]) -> str:
    tried = "\n".join(f"  {candidate}" for candidate in candidates)
    return (f"corpus not found; tried:\n{tried}\n"
            "Pass --corpus PATH (to `python -m pagedmoe.train tokenizer`, `train` or `compare`) "
            "to use another UTF-8 text file.")


def read_splits(path: str | Path, fraction: float = 1.0) -> tuple[str, str]:
    text = resolve_corpus(path).read_text(encoding="utf-8")
    text = text[: int(len(text) * fraction)]
    cut = int(len(text) * TRAIN_FRACTION)
    return text[:cut], text[cut:]


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)


def random_windows(ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def tiled_windows(ids: torch.Tensor, seq_len: int, limit: int) -> torch.Tensor:
    count = min(len(ids) // seq_len, limit)
    return ids[: count * seq_len].view(count, seq_len)
