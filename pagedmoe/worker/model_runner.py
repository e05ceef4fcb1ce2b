import logging
import tempfile
from dataclasses import dataclass

import torch

from pagedmoe.config import EngineConfig
from pagedmoe.distributed.parallel_state import COMM_SECONDS, RankInfo, broadcast_object, gather_to_driver, timed
from pagedmoe.engine.kv_cache_dp import PartitionedTransfers
from pagedmoe.engine.kv_cache_manager import BlockTransfers
from pagedmoe.engine.scheduler import SchedulerOutput
from pagedmoe.kv_transfer.connector import make_connector
from pagedmoe.engine.sequence import Sequence
from pagedmoe.layers.attention.cpu_kernel import ENTRY_POINTS, PagedDecodeKernel
from pagedmoe.layers.attention.cpu_prefill import PagedPrefillKernel
from pagedmoe.layers.attention.metadata import Workspace
from pagedmoe.layers.moe.offload.stats import expert_cache_stats
from pagedmoe.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedmoe.memory import keep_freed_memory
from pagedmoe.spec_decode.proposer import make_drafter
from pagedmoe.worker.cpu_threads import ThreadGovernor, default_num_threads
from pagedmoe.worker.backends import select_attention_backend
from pagedmoe.worker.cuda_graph import make_decode_graphs
from pagedmoe.worker.inputs import prepare_inputs
from pagedmoe.worker.kv_cache import KVCacheStorage, available_memory, block_bytes
from pagedmoe.worker.logits_constraints import apply_logits_processors, grammar_bitmask, logit_bias
from pagedmoe.worker.model_loader import prepare_model

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    sample_seqs: list[Sequence]  # sequences that sampled this step
    num_samples: list[int]  # rows per sequence (n when a prompt finishes and the request forks)
    sampled: SamplerOutput  # rows in the order of sample_seqs, expanded by num_samples, then by drafts:
    #                         a sequence with k draft tokens has k + 1 rows, one per position it verifies
    prompt_logprobs: dict[int, tuple[int, torch.Tensor, torch.Tensor]]  # seq_id -> (first position, logprobs, ids)
    expert_load: torch.Tensor | None  # [num_moe_layers, num_experts] tokens routed this step
    hidden_states: torch.Tensor | None = None  # [num_tokens, hidden] the final hidden states, for an MTP proposer


@dataclass
class StepPlan:
    """What every rank needs to run a step's forward: the tokens, positions and block tables, and the rows
    of each compute_logits call (one for the sampled rows, then one per prompt-logprob sequence)."""
    token_lists: list[list[int]]
    starts: list[int]
    block_tables: list[list[int]]
    window_tables: list[list[int]] | None
    logits_rows: list[list[int]]
    greedy: bool = False  # the sampled rows' tokens may come from the model's greedy head (layers/greedy_head.py)


@dataclass
class GreedyTokens:
    """The sampled rows' argmax tokens, from the greedy head, in place of their logits."""
    token_ids: torch.Tensor


class ModelRunner:
    """Turns a scheduled step into flat tensors and runs ONE forward for every scheduled sequence. With
    tensor_parallel_size > 1 this is rank 0 (the driver): it spawns the other ranks (distributed/executor.py)
    and broadcasts each step's block transfers and StepPlan, which every rank runs on its shard."""

    def __init__(self, config: EngineConfig, rank: RankInfo | None = None):
        self.config, self.device = config, torch.device(config.device)
        self.rank = rank or RankInfo(0, config.world_size)
        self.executor, self.kv_connector = self._start_ranks(), None
        try:
            self._build(config)
        except BaseException:
            self.shutdown()  # the other ranks stop too, and the process group is freed for the next engine
            raise

    def _build(self, config: EngineConfig):
        if config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        self.threads = None
        if self.device.type == "cpu":
            num_threads = config.num_threads or max(default_num_threads() // self.rank.world_size, 1)
            self.threads = ThreadGovernor(num_threads, config.adaptive_threads)
        self.model = prepare_model(config, self.rank)
        self.triton_attention = select_attention_backend(config) == "triton"
        self.drafter = make_drafter(config, self.model)  # a draft model, with KV of its own in the same blocks
        self.num_kv_tensors, self.token_shape = self.model.kv_cache_token_shape()
        self.sliding_window, self.layer_slots = self._hybrid_kv_layout()
        self.num_kv_layers = max(self.layer_slots) + 1 if self.layer_slots else config.hf_config.num_hidden_layers
        self.num_blocks, self.num_host_blocks = self._num_blocks()
        self.kv_cache = self._kv_storage(config)
        self.kv_cache.prefault(config.kv_prefault_memory)
        if self.triton_attention:
            from pagedmoe.layers.attention.triton_cache_ops import copy_blocks
            self.kv_cache.copy_kernel = copy_blocks
        self.workspace = Workspace(config.torch_dtype, self.device)
        self.decode_kernel = self._decode_kernel()
        self.prefill_kernel = self._prefill_kernel() if self.decode_kernel is not None else None
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, self.num_host_blocks, self.decode_kernel)
        self.decode_graphs = make_decode_graphs(config, self.model, self.kv_cache.device_cache, self.workspace,
                                                self.triton_attention, self.drafter is not None)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        moe_layers = getattr(self.model, "moe_layers", [])
        self.expert_load_shape = (len(moe_layers), moe_layers[0].num_experts) if moe_layers else None
        self.eplb = self._eplb_state(config)
        self.kv_connector = self._kv_connector(config)
        self.num_steps = 0

    def _kv_storage(self, config: EngineConfig) -> KVCacheStorage:
        self.num_disk_blocks = config.kv_offload_disk_bytes // self.block_bytes if config.kv_offload else 0
        disk_dir = (config.kv_offload_dir or tempfile.gettempdir()) if self.num_disk_blocks else None
        num_dummy = int(config.data_parallel_size > 1)  # data-parallel attention: an idle rank's dummy token
        return KVCacheStorage(self.num_kv_layers, self.num_kv_tensors, self.token_shape, self.num_blocks + num_dummy,
                              self.num_host_blocks, config.block_size, config.torch_dtype, self.device, disk_dir)

    def _kv_connector(self, config: EngineConfig):
        """The worker side of P/D's KV hand-off (kv_transfer/), or None."""
        connector = make_connector(config.kv_transfer_config)
        if connector is not None and self.layer_slots is not None:
            raise ValueError("kv_transfer_config: sliding-window KV (hybrid layout) is not handed off yet; "
                             "use --disable-hybrid-kv-cache-manager")
        if connector is not None:
            connector.register_kv_caches(self.kv_cache.device_cache, config.block_size)
        return connector

    def _eplb_state(self, config: EngineConfig):
        """The driver's EPLB window and schedule, where enable_eplb (distributed/eplb_state.py)."""
        if not config.enable_eplb or not self.rank.is_driver or not self.expert_load_shape:
            return None
        from pagedmoe.distributed.eplb_state import EplbState
        return EplbState(self.rank.world_size, config.num_redundant_experts, config.eplb_window_size,
                         config.eplb_step_interval)

    def _rebalance_experts(self):
        from pagedmoe.distributed.eplb_state import current_placement
        placement = self.eplb.next_placement(current_placement(self.model.moe_layers))
        self.executor.broadcast(placement)
        self.run_plan(placement)

    def _start_ranks(self):
        if not self.rank.is_driver or self.rank.world_size == 1:
            return None
        from pagedmoe.distributed.executor import MultiprocExecutor
        return MultiprocExecutor(self.config)

    def parallel_stats(self, expert_load: torch.Tensor | None):
        """distributed/stats.py's ParallelStats, or None in one process."""
        if self.rank.world_size == 1:
            return None
        from pagedmoe.distributed.stats import RankSeconds, parallel_stats
        self.rank_seconds = getattr(self, "rank_seconds", None) or RankSeconds()
        return parallel_stats(getattr(self.model, "moe_layers", []), expert_load, self.rank.world_size,
                              self.num_steps, self.rank_seconds.get(self.executor))

    def expert_cache_stats(self):
        """Offloaded experts' cache counters (layers/moe/offload/stats.py), or None."""
        return expert_cache_stats(getattr(self.model, "moe_layers", []))

    def shutdown(self):
        if self.executor is not None:
            self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _decode_kernel(self) -> PagedDecodeKernel | None:
        if not self.config.cpu_attention_kernel or self.device.type != "cpu" or self.num_kv_tensors == 1 \
                or self.triton_attention:
            return None
        if self.config.torch_dtype not in ENTRY_POINTS:
            return None
        try:
            return PagedDecodeKernel(self.config.torch_dtype)
        except RuntimeError as error:
            logger.warning("decode attention falls back to gather + matmuls: %s", error)
            return None

    def _prefill_kernel(self) -> PagedPrefillKernel | None:
        try:
            return PagedPrefillKernel(self.config.torch_dtype)
        except RuntimeError as error:
            logger.warning("prefill attention falls back to SDPA: %s", error)
            return None

    def _hybrid_kv_layout(self) -> tuple[int | None, list[int] | None]:
        """(sliding window, layer -> KV slot) where sliding-window layers keep their own block tables
        (engine/kv_cache_hybrid.py); (None, None) where every layer reads one table."""
        layout = getattr(self.model, "hybrid_kv_layout", lambda: None)()
        if layout is None or self.config.disable_hybrid_kv_cache_manager or self.config.kv_allocation == "static":
            return None, None
        return layout

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: the target's KV, and the draft model's in the same block."""
        target = block_bytes(self.num_kv_layers, self.num_kv_tensors, self.token_shape,
                             self.config.block_size, self.config.torch_dtype)
        return target + (self.drafter.block_bytes if self.drafter is not None else 0)

    def _num_blocks(self) -> tuple[int, int]:
        """Every rank holds the same blocks (its heads of them): rank 0 sizes the pool for all."""
        if self.rank.world_size == 1:
            return self._own_num_blocks()
        return broadcast_object(self._own_num_blocks() if self.rank.is_driver else None)

    def _own_num_blocks(self) -> tuple[int, int]:
        cfg = self.config
        num_host = max(cfg.swap_space_bytes // self.block_bytes, 1)
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks, num_host
        budget = cfg.kv_cache_memory or self._kv_budget()
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size) * (2 if self.layer_slots else 1)
        num_blocks = min(budget // self.block_bytes, useful)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold no KV block of {self.block_bytes} bytes")
        return num_blocks, num_host

    def _kv_budget(self) -> int:
        """CUDA: what gpu_memory_utilization leaves after a profiled forward (one rank: several would each
        need to run it); elsewhere a share of free memory."""
        if self.device.type == "cuda" and self.rank.world_size == 1:
            from pagedmoe.worker.device_memory import profiled_kv_budget
            kv_layout = (self.num_kv_layers, self.num_kv_tensors, self.token_shape)
            return profiled_kv_budget(self.config, self.model, kv_layout, self.triton_attention)
        return int(available_memory(self.device) * self.config.kv_cache_memory_fraction)

    def save_kv(self, save):
        """A KV connector's save of a finished request's prompt KV (before its blocks are freed)."""
        self.kv_connector.save_kv(save, self.kv_cache.device_cache, self.config.block_size)

    def apply_transfers(self, sched: SchedulerOutput):
        """The step's block copies (swap, offload, copy-on-write, prefix loads), once, before its forward."""
        if self.executor is not None and has_transfers(sched.transfers):
            self.executor.broadcast(sched.transfers)
        self.kv_cache.apply(own_transfers(sched.transfers, self.rank.rank))
        if self.drafter is not None:
            self.drafter.apply(sched.transfers)
        return self._load_remote_kv(sched.connector_meta.loads if sched.connector_meta is not None else [])

    def _load_remote_kv(self, loads) -> dict[str, Exception]:
        """A KV connector's loads before the forward; the requests whose load failed, with the error (their
        steps must not run on blocks that hold no KV: the engine fails them, the others go on)."""
        failed = {}
        for load in loads:
            try:
                self.kv_connector.start_load_kv(load, self.kv_cache.device_cache, self.config.block_size)
            except MemoryError:
                raise
            except Exception as error:  # a missing, partial or foreign file (safetensors raises its own type)
                failed[load.request_id] = error
        return failed

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.eplb is not None and self.eplb.is_due():
            self._rebalance_experts()
        self.num_steps += 1
        ends = [seq.num_computed_tokens + n for seq, n in zip(sched.seqs, sched.num_new_tokens)]
        prompt_rows = self._prompt_logprob_rows(sched, ends)
        sample_seqs = [s for s, end in zip(sched.seqs, ends) if end == len(s) + len(s.spec_token_ids)]
        num_samples = [_num_samples(seq) for seq in sample_seqs]
        batch = self._sampling_batch(sample_seqs, num_samples)
        if self.config.data_parallel_size > 1:
            hidden, meta, all_logits = self._forward_data_parallel(sched, ends, prompt_rows)
        else:
            greedy = not prompt_rows and self._takes_greedy_head(batch, sample_seqs, num_samples)
            hidden, meta, all_logits = self._forward_step(sched, ends, prompt_rows, greedy)
        if self.eplb is not None:
            self.eplb.record(meta.expert_load)
        sampled = self._sample(all_logits[0], sample_seqs, num_samples, batch)
        prompt_logprobs = self._prompt_logprobs(sched, prompt_rows, all_logits[1:])
        return ModelRunnerOutput(sample_seqs, num_samples, sampled, prompt_logprobs, meta.expert_load,
                                 self._drafter_hidden(hidden, meta))

    def _sample(self, logits, sample_seqs: list[Sequence], num_samples: list[int], batch: SamplingBatch):
        if isinstance(logits, GreedyTokens):
            return SamplerOutput(logits.token_ids, None, None, None, None)
        if any(n > 1 for n in num_samples):  # a forking sequence has no drafts: its one row serves n samples
            repeats = [r for seq, n in zip(sample_seqs, num_samples) for r in [n] * (1 + len(seq.spec_token_ids))]
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0)
        return self.sampler(self._processed(logits, sample_seqs, num_samples), batch)

    def _takes_greedy_head(self, batch: SamplingBatch, seqs: list[Sequence], num_samples: list[int]) -> bool:
        """Whether the step's samples are argmaxes of the raw logits, which the greedy head gives (one process:
        a rank's head holds part of the vocabulary)."""
        if getattr(self.model, "greedy_head", None) is None or self.executor is not None:
            return False
        return batch.is_plain_greedy and all(n == 1 for n in num_samples) and \
            not any(seq.params.logits_processors for seq in seqs)

    def _forward_step(self, sched: SchedulerOutput, ends: list[int], prompt_rows, greedy: bool = False):
        plan = self._plan(sched, ends, [self._sample_rows(sched, ends)] + [rows for _, rows in prompt_rows])
        plan.greedy = greedy
        if self.executor is not None:
            self.executor.broadcast(plan)
        return self.run_plan(plan)

    def _forward_data_parallel(self, sched: SchedulerOutput, ends: list[int], prompt_rows):
        """Each rank runs its own sequences; the logits come back to rank 0 and are put in schedule order."""
        from pagedmoe.distributed.data_parallel import DataParallelPlan, merge_logits, split_by_rank
        parts = split_by_rank(sched, ends, self.config.data_parallel_size)
        part_prompt_rows = [self._prompt_logprob_rows(part, part_ends) for part, part_ends in parts]
        plans = [self._plan(part, part_ends, [self._sample_rows(part, part_ends)] + [r for _, r in rows])
                 if part.seqs else None for (part, part_ends), rows in zip(parts, part_prompt_rows)]
        self.executor.broadcast(DataParallelPlan(plans))
        hidden, meta, by_rank = self.run_plan(DataParallelPlan(plans))
        prompt_seqs = [[seq for seq, _ in rows] for rows in part_prompt_rows]
        return hidden, meta, merge_logits(sched, ends, by_rank, prompt_seqs, prompt_rows)

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence], num_samples: list[int]) -> torch.Tensor:
        if not any(seq.params.logits_processors for seq in seqs):
            return logits
        return apply_logits_processors(logits.float(), _sampling_rows(seqs, num_samples))

    def _drafter_hidden(self, hidden: torch.Tensor, meta) -> torch.Tensor | None:
        """What the proposer drafts from: the final hidden states (MTP) or those entering its layers (EAGLE-3),
        in a tensor of their own (the engine keeps views of it; a replayed graph's output is reused)."""
        if self.drafter is None or not self.drafter.uses_hidden_states:
            return None
        return torch.cat(meta.aux_hidden, dim=-1) if meta.aux_hidden_layers else hidden.clone()

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan):
        """The step's forward and its compute_logits calls (the LM head may gather over ranks, so every rank
        makes the same calls); block transfers, from the driver's apply_transfers, are applied instead."""
        if not isinstance(plan, StepPlan):
            return self._run_request(plan)
        if self.threads is not None:
            self.threads.update()
        with timed("forward"):
            return self._forward(plan)

    def _run_request(self, request):
        """Block transfers, a data-parallel step, EPLB's new ExpertPlacement, or the driver asking for every
        rank's seconds."""
        from pagedmoe.distributed.data_parallel import DataParallelPlan
        from pagedmoe.distributed.eplb_state import ExpertPlacement, apply_placement
        if isinstance(request, (BlockTransfers, PartitionedTransfers)):
            return self.kv_cache.apply(own_transfers(request, self.rank.rank))
        if isinstance(request, DataParallelPlan):
            return self._run_own_part(request)
        if isinstance(request, ExpertPlacement):
            return apply_placement(self.model.moe_layers, request, self.rank.rank)
        return gather_to_driver(dict(COMM_SECONDS))

    def _run_own_part(self, plan):
        """This rank's sequences of a data-parallel step, or one dummy token in a block no sequence owns
        (the MoE layers' collectives need every rank); every rank's logits gathered on rank 0."""
        own = plan.plans[self.rank.rank]
        dummy = StepPlan([[0]], [0], [[self.num_blocks]], [[self.num_blocks]] if self.layer_slots else None, [])
        with timed("forward"):
            hidden, meta, logits = self._forward(own or dummy)
        return hidden, meta, gather_to_driver([t.cpu() for t in logits])

    def _forward(self, plan: StepPlan):
        input_ids, positions, meta = self._inputs(plan.token_lists, plan.starts, plan.block_tables)
        if plan.window_tables is not None:
            meta.window = self._inputs(plan.token_lists, plan.starts, plan.window_tables)[2]
        graph_size = self.decode_graphs.size_for(meta, len(input_ids)) if self.decode_graphs is not None else None
        if self.expert_load_shape and graph_size is None:
            meta.expert_load = torch.zeros(self.expert_load_shape, dtype=torch.long, device=self.device)
        meta.aux_hidden_layers = self.drafter.aux_layers if self.drafter is not None else ()
        logits_rows = plan.logits_rows
        if graph_size is not None:
            hidden = self.decode_graphs.replay(input_ids, positions, meta, graph_size)
        else:
            meta.output_rows, logits_rows = self._output_rows(logits_rows, len(input_ids))
            hidden = self.model(input_ids, positions, meta)
        rows = [torch.tensor(r, dtype=torch.long, device=self.device) for r in logits_rows]
        if plan.greedy and (tokens := self.model.greedy_head(hidden[rows[0]])) is not None:
            return hidden, meta, [GreedyTokens(tokens)]
        return hidden, meta, [self.model.compute_logits(hidden[r]) for r in rows]

    def _output_rows(self, logits_rows: list[list[int]], num_tokens: int):
        """The rows the step reads past the last layer, which then computes only those (as llama.cpp's
        output ids: the rest of a prompt needs its KV, not its MLP), and the logits rows as indices into them.
        None where every row is read, or the proposer drafts from the final hidden states."""
        if self.drafter is not None and self.drafter.uses_hidden_states:
            return None, logits_rows
        needed = sorted({row for rows in logits_rows for row in rows}) or [num_tokens - 1]  # kernels want a row
        if len(needed) == num_tokens:
            return None, logits_rows
        index = {row: i for i, row in enumerate(needed)}
        return (torch.tensor(needed, dtype=torch.long, device=self.device),
                [[index[row] for row in rows] for rows in logits_rows])

    def _plan(self, sched: SchedulerOutput, ends: list[int], logits_rows: list[list[int]]) -> StepPlan:
        starts = [seq.num_computed_tokens for seq in sched.seqs]
        windows = [seq.window_table for seq in sched.seqs] if self.layer_slots is not None else None
        return StepPlan([_tokens(seq, start, end) for seq, start, end in zip(sched.seqs, starts, ends)], starts,
                        [seq.block_table for seq in sched.seqs], windows, logits_rows)

    def _sample_rows(self, sched: SchedulerOutput, ends: list[int]) -> list[int]:
        rows, offset = [], 0
        for seq, num_new, end in zip(sched.seqs, sched.num_new_tokens, ends):
            offset += num_new
            num_drafts = len(seq.spec_token_ids)
            if end == len(seq) + num_drafts:
                rows.extend(range(offset - 1 - num_drafts, offset))
        return rows

    def _inputs(self, token_lists: list[list[int]], starts: list[int], block_tables: list[list[int]]):
        input_ids, positions, meta = prepare_inputs(token_lists, starts, block_tables, self.config.block_size,
                                                    self.kv_cache.device_cache, self.workspace, self.decode_kernel,
                                                    self.triton_attention)
        meta.layer_slots, meta.prefill_kernel = self.layer_slots, self.prefill_kernel
        return input_ids, positions, meta

    def _sampling_batch(self, seqs: list[Sequence], num_samples: list[int]) -> SamplingBatch:
        rows = _sampling_rows(seqs, num_samples)
        params = [seq.params for seq, _, _ in rows]
        as_tensor = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=self.device)
        counts, prompt_mask = self._penalty_inputs(rows)
        generators = [generator for _, generator, _ in rows]
        vocab = self.config.hf_config.vocab_size
        constraints = dict(logit_bias=logit_bias(rows, vocab, self.device),
                           token_bitmask=grammar_bitmask(seqs, num_samples, len(rows), -(-vocab // 32), self.device))
        return SamplingBatch(
            as_tensor([p.temperature for p in params]), as_tensor([p.top_p for p in params]),
            as_tensor([p.top_k for p in params], torch.long), as_tensor([p.min_p for p in params]),
            as_tensor([p.repetition_penalty for p in params]), as_tensor([p.presence_penalty for p in params]),
            as_tensor([p.frequency_penalty for p in params]), counts, prompt_mask, self._banned(rows),
            generators, max((_num_logprobs(p) for p in params), default=-1), *self._draft_rows(seqs, num_samples),
            **constraints)

    def _draft_rows(self, seqs: list[Sequence], num_samples: list[int]):
        """Draft ids and distributions for the rows of sequences whose drafts were sampled (not argmax)."""
        if not any(seq.spec_draft_probs is not None and seq.spec_token_ids for seq in seqs):
            return None, None
        ids, probs, vocab = [], [], self.config.hf_config.vocab_size
        for seq, n in zip(seqs, num_samples):
            num_drafts = len(seq.spec_token_ids)
            has_probs = seq.spec_draft_probs is not None and num_drafts
            ids += (seq.spec_token_ids if has_probs else [-1] * num_drafts) + [-1] * n
            rows = seq.spec_draft_probs[:num_drafts] if has_probs else torch.zeros(num_drafts, vocab)
            probs += [rows.to(self.device), torch.zeros(n, vocab, device=self.device)]
        return torch.tensor(ids, dtype=torch.long, device=self.device), torch.cat(probs)

    def _penalty_inputs(self, rows):
        if not any(_has_penalty(seq.params) for seq, _, _ in rows):
            return None, None
        vocab = self.config.hf_config.vocab_size
        counts = torch.zeros(len(rows), vocab, device=self.device)
        prompt_mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=self.device)
        for row, (seq, _, num_drafts) in enumerate(rows):  # a draft position sees the drafts before it
            out = torch.tensor(seq.output_token_ids + seq.spec_token_ids[:num_drafts], dtype=torch.long,
                               device=self.device)
            counts[row].index_add_(0, out, torch.ones(len(out), device=self.device))
            prompt_mask[row, torch.tensor(seq.token_ids[:seq.num_prompt_tokens], device=self.device)] = True
        return counts, prompt_mask

    def _banned(self, rows) -> torch.Tensor | None:
        under_min = [(r, seq) for r, (seq, _, num_drafts) in enumerate(rows)  # a grammar decides its own end
                     if seq.num_output_tokens + num_drafts < seq.params.min_tokens and seq.grammar is None]
        if not under_min:
            return None
        banned = torch.zeros(len(rows), self.config.hf_config.vocab_size, dtype=torch.bool, device=self.device)
        for row, seq in under_min:
            stop_ids = list(seq.request.eos_token_ids | set(seq.params.stop_token_ids))
            banned[row, torch.tensor(stop_ids, dtype=torch.long, device=self.device)] = True
        return banned

    def _prompt_logprob_rows(self, sched, ends) -> list[tuple[Sequence, list[int]]]:
        """Sequences whose prompt logprobs this step computes, with their rows of the step's hidden states."""
        result, offset = [], 0
        for seq, num_new, end in zip(sched.seqs, sched.num_new_tokens, ends):
            start, offset = end - num_new, offset + num_new
            last = min(end, seq.num_prompt_tokens - 1)
            if seq.request.needs_prompt_logprobs and seq.sample_index == 0 and last > start:
                result.append((seq, list(range(offset - num_new, offset - num_new + last - start))))
        return result

    def _prompt_logprobs(self, sched, prompt_rows, logits) -> dict[int, tuple[int, torch.Tensor, torch.Tensor]]:
        result = {}
        for (seq, rows), seq_logits in zip(prompt_rows, logits):
            start = seq.num_computed_tokens
            logprobs = torch.log_softmax(seq_logits.float(), dim=-1)
            result[seq.seq_id] = (start + 1, logprobs, torch.tensor(seq.token_ids[start + 1:start + 1 + len(rows)]))
        return result


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """Positions [start, end) of the sequence followed by its draft tokens (which sit past its tokens)."""
    tokens = seq.token_ids[start:end]
    return tokens + seq.spec_token_ids[:end - len(seq)] if end > len(seq) else tokens


def _num_samples(seq: Sequence) -> int:
    num = seq.params.num_samples
    return num if len(seq.request.seqs) < num and seq.num_output_tokens == 0 else 1


def _num_logprobs(params) -> int:
    if params.logprobs is not None:
        return params.logprobs
    return 0 if params.num_samples > params.n else -1


def _sampling_rows(seqs: list[Sequence], num_samples: list[int]) -> list[tuple[Sequence, torch.Generator | None, int]]:
    """(sequence, generator, drafts before the row): one row per sample of a forking sequence (each sample's
    own generator), else one per position the sequence verifies (1 + its drafts, all from its generator)."""
    rows = []
    for seq, n in zip(seqs, num_samples):
        if n > 1:
            rows += [(seq, seq.request.generators[i] if seq.request.generators else None, 0) for i in range(n)]
        else:
            rows += [(seq, seq.generator, i) for i in range(1 + len(seq.spec_token_ids))]
    return rows


def _has_penalty(params) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def own_transfers(transfers, rank: int) -> BlockTransfers:
    return transfers.by_rank[rank] if isinstance(transfers, PartitionedTransfers) else transfers


def has_transfers(transfers) -> bool:
    parts = transfers.by_rank if isinstance(transfers, PartitionedTransfers) else [transfers]
    return any(any(vars(part).values()) for part in parts)
