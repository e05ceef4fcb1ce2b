"""A smaller model of the same vocabulary drafts k tokens, one forward per draft. Its KV lives in storage of
its own indexed by the target's block tables: the same block ids and slots, and every block copy the target's
blocks get (swap, offload, copy-on-write) is applied to it too, so preemption and forks carry it. A rollback
is bookkeeping: seq.num_drafter_tokens counts the leading positions whose draft KV matches the sequence's
tokens; each proposal first runs the draft over the positions past it (the whole prompt the first time),
then one position per further draft, into the lookahead slots the scheduler allocated (KVCacheManager)."""
import dataclasses
from dataclasses import dataclass

import torch

from pagedmoe.layers.attention.metadata import Workspace
from pagedmoe.layers.sampler import inverse_cdf, sampling_probs, uniform_noise
from pagedmoe.spec_decode.config import SpeculativeConfig
from pagedmoe.spec_decode.fused_drafters import MAX_ROWS, FusedDraftModel
from pagedmoe.worker.inputs import decode_inputs, pad_block_tables, prepare_inputs
from pagedmoe.worker.kv_cache import KVCacheStorage, block_bytes
from pagedmoe.worker.model_loader import prepare_model

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CATCH_UP_ROWS, MIN_CATCH_UP = 256, 4  # a drafter far behind catches up over its last positions only: this many
#  rows for a proposal in all, at least MIN_CATCH_UP a sequence (16 had made a probe of speculation at batch 64 cost
#  11 ms of catch-up before its verify step)
KEPT_ROWS = 16  # what a sequence that stopped drafting keeps of its stash (MTPProposer.stash_hidden)


def can_speculate(seq) -> bool:
    """Beam search runs without drafts (its candidates are ranked per step, not sampled). Penalties and
    min_tokens bans apply per draft position, each row seeing the drafts before it (ModelRunner)."""
    return seq.request.beam is None


def skip_positions(seq, skip: int):
    """The drafter skips the next `skip` positions it has not caught up on (and their stashed hidden states,
    MTP / EAGLE) and attends from the position after them."""
    if seq.spec_hidden:
        seq.spec_hidden = drop_rows(seq.spec_hidden, skip)
    seq.num_drafter_tokens = seq.drafter_start = seq.num_drafter_tokens + skip


def skip_behind(seq, limit: int):
    """The drafter skips all but the last `limit` positions it has not caught up on, and attends from there."""
    if (skip := seq.num_computed_tokens - seq.num_drafter_tokens - limit) > 0:
        skip_positions(seq, skip)


def drop_rows(chunks: list[torch.Tensor], num_rows: int) -> list[torch.Tensor]:
    """The rows after the first num_rows, as one chunk; the chunks wholly dropped are not copied (a cat of a
    bounded stash, 65 one-row chunks, had cost ~47 us a sequence)."""
    index = 0
    while index < len(chunks) and chunks[index].shape[0] <= num_rows:  # shape[0]: len() of a tensor is slower
        num_rows -= chunks[index].shape[0]
        index += 1
    return [torch.cat(chunks[index:])[num_rows:]] if index < len(chunks) else []


@dataclass
class DraftInputs:
    token_lists: list[list[int]]
    starts: list[int]
    hidden: torch.Tensor | None = None  # [num_tokens, hidden] one target hidden state per token (MTP, EAGLE)


class DraftModelProposer:
    uses_hidden_states = False  # whether the proposer reads the target's hidden states (seq.spec_hidden)
    aux_layers: tuple[int, ...] = ()  # the target layers whose input hidden states it reads (EAGLE-3)
    dense_step: FusedDraftModel | None = None  # every greedy draft step as one kernel call (fused_drafters.py)

    def __init__(self, config, spec: SpeculativeConfig):
        self.spec = spec
        self.config = dataclasses.replace(config, model=spec.model, tokenizer=None, skip_tokenizer_init=True,
                                          dtype=DTYPE_NAMES[config.torch_dtype], speculative_config=None,
                                          expert_cache_memory=None)
        hf, target = self.config.hf_config, config.hf_config
        if hf.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocab_size ({hf.vocab_size}) is not the "
                             f"target's ({target.vocab_size})")
        self.model = prepare_model(self.config)
        self.dense_step = FusedDraftModel.of(self.model)
        self.setup(config)

    def setup(self, config):
        self.num_kv_tensors, self.token_shape = self.model.kv_cache_token_shape()
        self.max_positions = self.config.hf_config.max_position_embeddings
        self.generator = torch.Generator(self.config.device).manual_seed(config.seed + 1)
        self.kv_cache = self.workspace = self.decode_kernel = None

    @property
    def num_layers(self) -> int:
        return self.config.hf_config.num_hidden_layers

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.num_layers, self.num_kv_tensors, self.token_shape, self.config.block_size,
                           self.config.torch_dtype)

    def allocate(self, num_blocks: int, num_host_blocks: int, decode_kernel=None):
        """KV storage with as many device and host blocks as the target's, block for block."""
        cfg = self.config
        self.kv_cache = KVCacheStorage(self.num_layers, self.num_kv_tensors, self.token_shape, num_blocks,
                                       num_host_blocks, cfg.block_size, cfg.torch_dtype, torch.device(cfg.device))
        self.kv_cache.prefault(cfg.kv_prefault_memory)  # the target's blocks, block for block: the same first touches
        self.workspace = Workspace(cfg.torch_dtype, torch.device(cfg.device))
        self.decode_kernel = decode_kernel if self.num_kv_tensors != 1 else None  # none for MLA

    def apply(self, transfers):
        self.kv_cache.apply_copies(transfers)

    @torch.inference_mode()
    def propose(self, seqs: list, ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[i] drafts for seqs[i] (fewer where the draft's positions end), with the distributions
        they were sampled from when speculative_config.draft_sample_method is "probabilistic"."""
        ks = self.capped(seqs, ks)
        live = [seq for seq, k in zip(seqs, ks) if k]
        if self._kernel_drafts(live):
            self._skip_far_behind(live)
        if self._fuses_dense(live):
            return self._propose_fused(seqs, ks)
        ks = self.step_ks(seqs, ks)
        drafts = [([], []) for _ in seqs]
        live = [i for i, k in enumerate(ks) if k]
        inputs = self.first_inputs([seqs[i] for i in live])
        tables = pad_block_tables([seqs[i].block_table for i in live]) if live else None
        for step in range(max(ks, default=0)):
            tokens, probs, hidden = self._step([seqs[i] for i in live], inputs, tables)
            for i, token, row in zip(live, tokens, probs):
                drafts[i][0].append(token)
                drafts[i][1].append(row)
                self.advance(seqs[i], step)
            kept = [j for j, i in enumerate(live) if ks[i] > step + 1]
            if len(kept) < len(live):
                live, tables, hidden = [live[j] for j in kept], tables[kept], hidden[kept]
            inputs = self.next_inputs([seqs[i] for i in live], [tokens[j] for j in kept], hidden, step + 1)
        return [(ids, None if not rows or rows[0] is None else torch.stack(rows)) for ids, rows in drafts]

    def step_ks(self, seqs, ks: list[int]) -> list[int]:
        """The drafts step-by-step drafting takes: none for a sequence that skipped positions, since the draft
        model's modules attend from position 0."""
        return [0 if seq.drafter_start else k for seq, k in zip(seqs, ks)]

    def _kernel_drafts(self, live) -> bool:
        """Whether the kernel can draft these sequences: greedy drafts, float32 weights on CPU."""
        if self.dense_step is None or not live or not self.dense_step.fits(self.kv_cache.device_cache):
            return False
        return self._drafts_greedily(live)

    def _fuses_dense(self, live) -> bool:
        """The kernel for few rows, and always once a sequence skipped positions (only it attends past them)."""
        if not self._kernel_drafts(live):
            return False
        num_rows = sum(len(seq) - seq.num_drafter_tokens for seq in live)
        return num_rows <= MAX_ROWS or any(seq.drafter_start for seq in live)

    def _skip_far_behind(self, seqs):
        """As EAGLE-3's head: a draft model that the batch size or the switch kept from drafting catches up over
        its last positions only (CATCH_UP_ROWS for the proposal, at least MIN_CATCH_UP a sequence) and
        attends from there on; over whole contexts a probe of speculation at batch 64 cost ~20 ms. Only such
        sequences, so that seeded sampling stays the same alone and in a batch where drafting never pauses."""
        limit = max(MIN_CATCH_UP, CATCH_UP_ROWS // len(seqs))
        for seq in seqs:
            if seq.drafts_paused and (skip := len(seq) - seq.num_drafter_tokens - limit) > 0:
                skip_positions(seq, skip)
            seq.drafts_paused = False

    def _propose_fused(self, seqs, ks: list[int]) -> list[tuple[list[int], None]]:
        live = [i for i, k in enumerate(ks) if k]
        inputs = self.first_inputs([seqs[i] for i in live])
        tables = pad_block_tables([seqs[i].block_table for i in live])
        _, drafts = self.dense_step(self.kv_cache.device_cache, inputs.token_lists, inputs.starts, tables,
                                    [ks[i] for i in live], [seqs[i].drafter_start for i in live])
        return self.take_drafts(seqs, live, drafts, [ks[i] - 1 for i in live])  # the last draft's KV is unwritten

    def take_drafts(self, seqs, live: list[int], drafts: list[list[int]], steps: list[int]) -> list:
        """A kernel's greedy drafts for seqs[live[j]], its draft state advanced as after step steps[j]."""
        result = [([], None) for _ in seqs]
        for i, ids, step in zip(live, drafts, steps):
            self.advance(seqs[i], step)
            result[i] = (ids, None)
        return result

    def _drafts_greedily(self, seqs) -> bool:
        return self.spec.draft_sample_method == "greedy" or all(s.params.temperature == 0 for s in seqs)

    def capped(self, seqs, ks: list[int]) -> list[int]:
        """The drafts each sequence can take before the draft's positions end."""
        return [max(min(k, self.max_positions - len(seq) - 1), 0) for seq, k in zip(seqs, ks)]

    def first_inputs(self, seqs) -> DraftInputs:
        """The positions past the draft's KV, the whole prompt the first time; the last predicts draft 1."""
        return DraftInputs([seq.token_ids[seq.num_drafter_tokens:] for seq in seqs],
                           [seq.num_drafter_tokens for seq in seqs])

    def next_inputs(self, seqs, tokens: list[int], hidden: torch.Tensor, step: int) -> DraftInputs:
        """Draft `step` (from 1) in at its position, to predict the next."""
        return DraftInputs([[t] for t in tokens], [len(seq) - 1 + step for seq in seqs])

    def advance(self, seq, step: int):
        seq.num_drafter_tokens = len(seq) + step

    def forward(self, input_ids, positions, meta, hidden: torch.Tensor | None) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def _step(self, seqs, inputs: DraftInputs, tables: torch.Tensor) -> tuple[list[int], list, torch.Tensor]:
        """One draft forward: each sequence's next token from the row of its last input token."""
        input_ids, positions, meta = self._prepare(seqs, inputs, tables)
        hidden = self.forward(input_ids, positions, meta, inputs.hidden)
        if len(hidden) != len(seqs):  # the last row of each sequence's tokens
            last_rows = torch.cumsum(torch.tensor([len(t) for t in inputs.token_lists]), 0) - 1
            hidden = hidden[last_rows.to(hidden.device)]
        return *self._choose(self.model.compute_logits(hidden).float(), seqs), hidden

    def _prepare(self, seqs, inputs: DraftInputs, tables: torch.Tensor):
        """The step's inputs; a step of one token per sequence reuses the block tables (decode kernel)."""
        cfg, cache = self.config, self.kv_cache.device_cache
        if self.decode_kernel is None or any(len(tokens) != 1 for tokens in inputs.token_lists):
            return prepare_inputs(inputs.token_lists, inputs.starts, [s.block_table for s in seqs], cfg.block_size,
                                  cache, self.workspace, self.decode_kernel)
        positions = torch.tensor(inputs.starts, dtype=torch.long)
        meta = decode_inputs(positions, tables, cfg.block_size, cache, self.workspace, self.decode_kernel)
        device = self.workspace.buffer.device
        return torch.tensor([t[0] for t in inputs.token_lists], device=device), positions.to(device), meta

    def _choose(self, logits: torch.Tensor, seqs) -> tuple[list[int], list]:
        """Argmax drafts, or drafts sampled from the draft's distribution under each request's temperature,
        top-k, top-p and min-p (greedy requests always argmax), with that distribution kept to verify."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
        if self.spec.draft_sample_method == "greedy" or not sampled:
            return tokens.tolist(), [None] * len(seqs)
        probs = draft_probs(logits[sampled], [seqs[i].params for i in sampled])
        generators = [seqs[i].generator for i in sampled]
        tokens[sampled] = inverse_cdf(probs, uniform_noise(range(len(sampled)), generators, self.generator))
        rows = [None] * len(seqs)
        for index, row in zip(sampled, probs):
            rows[index] = row
        return tokens.tolist(), rows


def draft_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax of the logits under each row's temperature, top-k, top-p and min-p: the target's transforms."""
    as_tensor = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=logits.device)
    return sampling_probs(logits, as_tensor([p.temperature for p in params]),
                          as_tensor([p.top_k for p in params], torch.long), as_tensor([p.top_p for p in params]),
                          as_tensor([p.min_p for p in params]))
