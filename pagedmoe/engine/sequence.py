import time
from enum import Enum, auto

import torch

from pagedmoe.outputs import Logprob, RequestMetrics
from pagedmoe.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()
    WAITING_FOR_REMOTE_KVS = auto()  # blocks allocated, an async KV connector reading the prompt's KV into them
    FINISHED = auto()


class Request:
    """One user request: its prompt, parameters and the n sequences sampled from it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, cache_salt: str | None = None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.cache_salt = cache_salt
        self.num_cached_tokens: int | None = None
        self.params = params
        self.metrics = RequestMetrics(arrival_time or time.time())
        self.generators = _make_generators(params)
        self.eos_token_ids: set[int] = set()
        self.bad_words_token_ids: list[list[int]] = []
        extra = params.extra_args or {}
        self.kv_transfer_params: dict | None = extra.get("kv_transfer_params")  # vLLM's P/D hand-off, in
        self.kv_transfer_params_out: dict | None = None  # and out (a prefill instance's answer)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.seqs: list[Sequence] = []
        self.beam = None  # BeamSearchParams for a beam-search request
        self.finished_beams: list[Sequence] = []
        self.error: str | None = None  # why the request failed (its outputs end with finish_reason "error")
        self.bad_input = False  # it failed on its own parameters (a server answers 400)
        self.num_sent: dict[int, tuple[int, int, int]] = {}  # DELTA outputs: tokens, chars, logprobs sent per index

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)


def _make_generators(params: SamplingParams) -> list[torch.Generator] | None:
    if params.seed is None:
        return None
    return [torch.Generator().manual_seed(params.seed + i) for i in range(params.num_samples)]


class Sequence:
    def __init__(self, seq_id: int, request: Request, token_ids: list[int], sample_index: int = 0):
        self.seq_id, self.request, self.sample_index = seq_id, request, sample_index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.host_block_table: list[int] = []
        self.window_table: list[int] = []  # hybrid KV: the sliding-window layers' blocks (kv_cache_hybrid.py)
        self.host_window_table: list[int] = []
        self.num_window_freed = 0  # leading window_table entries freed: wholly outside the window
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.output_text = ""
        self.decode_stream = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.beam_candidates = None  # list[BeamCandidate] sampled but not yet selected
        self.spec_token_ids: list[int] = []  # draft tokens for the next step: not committed, never hashed
        self.spec_draft_probs: torch.Tensor | None = None  # [k, vocab] the distributions drafts were sampled from
        self.num_drafter_tokens = 0  # leading positions whose KV a draft model holds (spec_decode/draft_model.py)
        self.drafter_start = 0  # EAGLE-3: the first of them its head attends (it skipped the ones before)
        self.drafts_paused = False  # kept from drafting by the batch size or the adaptive switch since it last drafted
        self.dp_rank: int | None = None  # data-parallel attention: the rank holding this sequence's KV
        self.grammar = None  # structured outputs: the tokens it may sample next (structured_output/grammar.py)
        self.spec_hidden: list[torch.Tensor] = []  # MTP / EAGLE: target hidden states of the positions from
        #                                              num_drafter_tokens on, one chunk per step (appends are O(1))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def generator(self) -> torch.Generator | None:
        gens = self.request.generators
        return gens[self.sample_index] if gens else None

    def keep_hidden(self, num_rows: int):
        """The first num_rows stashed hidden states (the rest were at rejected positions)."""
        chunks = self.spec_hidden
        if sum(chunk.shape[0] for chunk in chunks) > num_rows:
            self.spec_hidden = [(chunks[0] if len(chunks) == 1 else torch.cat(chunks))[:num_rows]]

    def drop_drafts(self):
        """The pending drafts are dropped (preemption): the draft model's KV past the last token is stale."""
        self.spec_token_ids, self.spec_draft_probs = [], None
        self.num_drafter_tokens = min(self.num_drafter_tokens, len(self))

    def fork(self, seq_id: int, sample_index: int) -> "Sequence":
        child = Sequence(seq_id, self.request, list(self.token_ids), sample_index)
        child.num_computed_tokens, child.status = self.num_computed_tokens, self.status
        child.block_hashes, child.num_cached_blocks = list(self.block_hashes), self.num_cached_blocks
        child.num_drafter_tokens, child.spec_hidden = self.num_drafter_tokens, list(self.spec_hidden)
        child.drafter_start = self.drafter_start
        child.cumulative_logprob, child.output_text = self.cumulative_logprob, self.output_text
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child
