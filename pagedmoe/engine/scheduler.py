import logging
from collections import deque
from dataclasses import dataclass

from pagedmoe.config import EngineConfig
from pagedmoe.engine.kv_cache_manager import BlockTransfers, KVCacheManager
from pagedmoe.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    transfers: BlockTransfers
    connector_meta: object | None = None  # KV connector loads the worker runs before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not (self.connector_meta is not None and self.connector_meta.loads)


class Scheduler:
    """vLLM v1-style: one token budget per step, no prefill/decode phases. Running sequences first
    (preempting the newest when blocks run out), then swapped-out ones, then new admissions;
    a long prompt is chunked across steps and batched with decodes."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, connector=None):
        self.config, self.kv, self.connector = config, kv, connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.waiting_for_remote_kvs: list[Sequence] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.waiting_for_remote_kvs)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], BlockTransfers())
        budget = self.config.max_num_batched_tokens
        cap = self._request_cap(budget)
        num_preempted = sum(self.num_preemptions.values())
        budget = self._schedule_running(out, budget, cap)
        if sum(self.num_preemptions.values()) == num_preempted:
            budget = self._schedule_swapped(out, budget, cap)
            if not self.swapped:
                self._schedule_waiting(out, budget, cap)
        out.transfers = self.kv.take_transfers()
        out.connector_meta = self.connector.build_connector_meta() if self.connector is not None else None
        return out

    def _request_cap(self, budget: int) -> int:
        """The most new tokens one request gets this step: long_prefill_token_threshold where another request
        runs or waits (as vLLM, a request alone has nobody to starve), else the whole budget."""
        threshold = self.config.long_prefill_token_threshold
        num_eligible = len(self.running) + len(self.waiting) + len(self.swapped)
        return threshold if 0 < threshold < budget and num_eligible > 1 else budget

    def _schedule_running(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(len(seq) + len(seq.spec_token_ids) - seq.num_computed_tokens, budget, cap)
            del seq.spec_token_ids[max(seq.num_computed_tokens + num_new - len(seq), 0):]  # drafts past the budget
            if num_new == 0:
                index += 1
                continue
            if not self._allocate_or_preempt(seq, num_new):
                break
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_new: int) -> bool:
        while not self.kv.allocate_slots(seq, num_new):
            victim = self._newest_sharing_blocks_with(seq)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _newest_sharing_blocks_with(self, seq: Sequence) -> Sequence:
        """The newest running sequence whose blocks come from seq's pool (all of them, but under
        data-parallel attention, where each rank has a pool of its own); seq itself at the last."""
        index = max(i for i, s in enumerate(self.running) if s.dp_rank == seq.dp_rank)
        return self.running.pop(index)

    def _preempt(self, seq: Sequence):
        seq.drop_drafts()
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            self.kv.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.num_preemptions["swap"] += 1
            return
        self._requeue(seq)
        self.num_preemptions["recompute"] += 1

    def _requeue(self, seq: Sequence):
        """seq computes again from its first token: its blocks freed, it waits at the front of the queue."""
        self.kv.free(seq)
        seq.num_computed_tokens = seq.num_drafter_tokens = seq.drafter_start = 0
        seq.spec_hidden = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(len(seq) - seq.num_computed_tokens, budget, cap)
            if not self.kv.can_swap_in(seq, num_new):
                break
            self.kv.swap_in(seq)
            assert self.kv.allocate_slots(seq, num_new)
            budget = self._start_running(self.swapped.popleft(), num_new, out, budget)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, cap: int) -> int:
        while self.waiting and budget > 0 and self._num_admitted() < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._wants_remote_kv(seq):
                if not self._admit_with_remote_kv(seq):
                    break
                budget = self._start_after_remote_kv(self.waiting.popleft(), out, budget)
                continue
            cached = self.kv.find_cached_prefix(seq) if not seq.block_table else []
            num_new = min(len(seq) - max(seq.num_computed_tokens, len(cached) * self.kv.block_size), budget, cap)
            if not self.kv.allocate_slots(seq, num_new, cached):
                break
            if self.kv.drop_last_hit:  # an MTP's KV over the cached blocks is taken as it is
                seq.num_drafter_tokens = seq.num_computed_tokens
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = seq.num_computed_tokens
            if self.kv.enable_caching:
                self.kv.record_prefix_lookup(len(seq), cached)
            budget = self._start_running(self.waiting.popleft(), num_new, out, budget)
        return budget

    def _num_admitted(self) -> int:
        return len(self.running) + len(self.waiting_for_remote_kvs)

    def _wants_remote_kv(self, seq: Sequence) -> bool:
        return (self.connector is not None and not seq.block_table and seq.num_output_tokens == 0
                and self.connector.wants_remote_prefill(seq.request.kv_transfer_params)
                and self.connector.get_num_new_matched_tokens(seq) > 0)

    def _admit_with_remote_kv(self, seq: Sequence) -> bool:
        """Blocks for the whole prompt, the KV of all but its last token loaded into them (the connector
        queues the load for this step's worker): the step computes one token."""
        num_external = self.connector.get_num_new_matched_tokens(seq)
        if not self.kv.allocate_slots(seq, len(seq), delay_cache=True):  # cached once they hold the KV
            return False
        seq.num_computed_tokens = num_external
        seq.request.num_cached_tokens = num_external
        self.connector.update_state_after_alloc(seq, num_external)
        seq.request.kv_transfer_params = None  # one hand-off per request: a recompute after preemption is local
        return True

    def _start_after_remote_kv(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """A sync load runs before this step's forward; an async one leaves seq waiting (vLLM's
        WAITING_FOR_REMOTE_KVS) until update_connector_output reports its read."""
        if not self.connector.load_kv_async:
            return self._start_running(seq, 1, out, budget)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs.append(seq)
        return budget

    def update_connector_output(self, output) -> dict:
        """The connector's finished transfers: a sequence whose KV arrived runs on (its last prompt token);
        returns the failed reads, {request id: error}."""
        for seq in [s for s in self.waiting_for_remote_kvs if s.request.request_id in output.finished_recving]:
            self.waiting_for_remote_kvs.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self.connector.update_connector_output(output, self.kv)
        return output.failed_recving

    def recompute_failed_loads(self, failed_loads: dict) -> dict:
        """kv_load_failure_policy "recompute": a request whose remote KV did not load prefills here instead
        (its blocks, never cached, are freed); returns the failures left to fail (policy "fail": all)."""
        if not failed_loads or self.connector.config.kv_load_failure_policy != "recompute":
            return failed_loads
        for seq in [s for s in (*self.running, *self.waiting_for_remote_kvs) if s.request.request_id in failed_loads]:
            logger.warning("kv_transfer: request %s's remote KV did not load (%s); it prefills here",
                           seq.request.request_id, failed_loads[seq.request.request_id])
            self._remove(seq)
            seq.request.kv_transfer_params, seq.request.num_cached_tokens = None, None
            self._requeue(seq)
        return {}

    def _start_running(self, seq: Sequence, num_new: int, out: SchedulerOutput, budget: int) -> int:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        return budget - num_new

    def add_forks(self, parent: Sequence, children: list[Sequence]):
        queue = self._queue_of(parent)
        index = list(queue).index(parent) + 1
        for offset, child in enumerate(children):
            self.kv.fork(parent, child)
            queue.insert(index + offset, child)

    def finish(self, seq: Sequence, failed: bool = False):
        self._remove(seq)
        if self.connector is not None:
            self.connector.before_free(seq, self.kv)
        (self.kv.discard if failed else self.kv.free)(seq)
        seq.status = SequenceStatus.FINISHED

    def _queue_of(self, seq: Sequence):
        return {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
                SequenceStatus.SWAPPED: self.swapped,
                SequenceStatus.WAITING_FOR_REMOTE_KVS: self.waiting_for_remote_kvs}.get(seq.status)

    def _remove(self, seq: Sequence):
        queue = self._queue_of(seq)
        if queue is not None and seq in queue:
            queue.remove(seq)
