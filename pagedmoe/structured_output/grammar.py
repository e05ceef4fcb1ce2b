import torch


class Grammar:
    """One sequence's place in its request's grammar: which tokens may come next. The engine advances it
    with each committed token; the model runner fills the sequence's bitmask rows, walking through pending
    draft tokens and rolling back after."""

    def __init__(self, xgr, compiled, stop_token_ids: list[int], matcher=None):
        self.xgr, self.compiled, self.stop_token_ids = xgr, compiled, stop_token_ids
        self.matcher = matcher or xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None,
                                                     terminate_without_stop_token=not stop_token_ids)

    def fork(self) -> "Grammar":
        """The same grammar at the same place (a sample of n > 1 forking)."""
        return Grammar(self.xgr, self.compiled, self.stop_token_ids, self.matcher.fork())

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: list[int]):
        """Rows first_row .. first_row + len(drafts): the next-token mask after each prefix of the drafts.
        Past a draft the grammar refuses, the rows repeat the last mask (the target cannot sample that draft,
        so those rows are never kept)."""
        num_accepted = 0
        for offset in range(len(draft_token_ids) + 1):
            row = first_row + offset
            if offset == num_accepted:
                self.matcher.fill_next_token_bitmask(bitmask, row)
            else:
                bitmask[row] = bitmask[row - 1]
            if offset < len(draft_token_ids) and offset == num_accepted and not self.is_terminated:
                num_accepted += self.accept(draft_token_ids[offset])
        if num_accepted:
            self.matcher.rollback(num_accepted)
