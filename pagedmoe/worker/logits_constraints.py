"""Per-row constraints on the logits of a step: logit_bias, allowed_token_ids, bad_words and user logits
processors (an additive [R, V] bias, or a callable per row), and structured outputs (a packed token bitmask)."""
import torch

from pagedmoe.engine.sequence import Sequence

Row = tuple[Sequence, torch.Generator | None, int]  # (sequence, generator, drafts before the row)


def has_bias(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.logit_bias) or p.allowed_token_ids is not None or bool(seq.request.bad_words_token_ids)


def logit_bias(rows: list[Row], vocab_size: int, device) -> torch.Tensor | None:
    if not any(has_bias(seq) for seq, _, _ in rows):
        return None
    bias = torch.zeros(len(rows), vocab_size, device=device)
    for row, (seq, _, num_drafts) in enumerate(rows):
        if has_bias(seq):
            _fill_bias(bias[row], seq, seq.output_token_ids + seq.spec_token_ids[:num_drafts])
    return bias


def _fill_bias(bias: torch.Tensor, seq: Sequence, output_ids: list[int]):
    params = seq.params
    if params.allowed_token_ids is not None:
        bias.fill_(float("-inf"))
        bias[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = 0.0
    for token_id, value in (params.logit_bias or {}).items():
        bias[token_id] += value
    banned = banned_bad_words(seq.request.bad_words_token_ids, output_ids)
    if banned:
        bias[torch.tensor(banned, dtype=torch.long)] = float("-inf")


def banned_bad_words(bad_words_token_ids: list[list[int]], output_ids: list[int]) -> list[int]:
    """As vLLM: a bad word's last token is banned where the output so far ends with the tokens before it
    (a one-token word always)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or output_ids[len(output_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def apply_logits_processors(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """vLLM's per-request logits_processors: fn(output_token_ids, logits_row) -> logits_row."""
    for row, (seq, _, num_drafts) in enumerate(rows):
        for processor in seq.params.logits_processors or ():
            logits[row] = processor(seq.output_token_ids + seq.spec_token_ids[:num_drafts], logits[row])
    return logits


def grammar_bitmask(seqs: list[Sequence], num_samples: list[int], num_rows: int, width: int,
                    device) -> torch.Tensor | None:
    """[R, ceil(V / 32)] int32 bits of the tokens each row may sample (-1: every token); a speculating
    sequence's rows walk its drafts."""
    if not any(seq.grammar is not None for seq in seqs):
        return None
    bitmask, row = torch.full((num_rows, width), -1, dtype=torch.int32), 0
    for seq, n in zip(seqs, num_samples):
        num_seq_rows = n if n > 1 else 1 + len(seq.spec_token_ids)
        if seq.grammar is not None:
            seq.grammar.fill_rows(bitmask, row, seq.spec_token_ids if n == 1 else [])
            bitmask[row + 1:row + n] = bitmask[row]  # n > 1: every sample starts from the same state
        row += num_seq_rows
    return bitmask.to(device)
