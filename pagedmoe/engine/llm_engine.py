import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, fields

import torch
from transformers import AutoTokenizer, GenerationConfig

from pagedmoe.beam_search import BeamCandidate, BeamSearchParams, beam_score, select_beams
from pagedmoe.config import EngineConfig
from pagedmoe.engine.detokenizer import Detokenizer
from pagedmoe.engine.isolation import (EngineStepError, describe, failures_into, is_bad_input, is_fatal,
                                       split_by_request)
from pagedmoe.engine.kv_cache_factory import make_kv_cache_manager
from pagedmoe.engine.output_kind import as_output_kind, wants_output
from pagedmoe.engine.scheduler import Scheduler, SchedulerOutput
from pagedmoe.engine.sequence import Request, Sequence, SequenceStatus
from pagedmoe.engine.token_params import bad_words_token_ids, check_token_params
from pagedmoe.engine_args import engine_config
from pagedmoe.inputs import PromptType
from pagedmoe.kv_transfer.connector import make_connector
from pagedmoe.kv_transfer.zmq_publisher import make_publisher
from pagedmoe.memory import freeze_startup_heap
from pagedmoe.outputs import CompletionOutput, Logprob, RequestOutput
from pagedmoe.sampling_params import SamplingParams
from pagedmoe.spec_decode.acceptance import num_accepted
from pagedmoe.spec_decode.adaptive import decode_step_kind, make_switch
from pagedmoe.spec_decode.draft_model import can_speculate
from pagedmoe.spec_decode.proposer import SpecDecodeStats, make_proposer, max_draft_tokens
from pagedmoe.structured_output.manager import StructuredOutputManager
from pagedmoe.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_finished_requests: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached (not computed), in any tier
    prefix_cache_hits_by_tier: dict[str, int]  # device / host / disk
    num_offloaded_blocks: int  # evicted cached blocks copied to the host tier
    num_spilled_blocks: int  # host-tier blocks written to the disk tier
    expert_load: list[list[int]]  # per MoE layer, tokens routed to each expert since start
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: drafts and accepted tokens
    parallel: object | None = None  # with several ranks: distributed/stats.py's ParallelStats
    expert_cache: object | None = None  # offloaded experts: layers/moe/offload/stats.py's ExpertCacheStats

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total


class LLMEngine:
    """Each step is schedule -> execute -> postprocess."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else AutoTokenizer.from_pretrained(config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.runner = ModelRunner(config)
        static = self._static_reserve if config.kv_allocation == "static" else None
        spec = config.speculative_config
        lookahead = spec.num_speculative_tokens if spec is not None and spec.uses_draft_kv else 0
        self.kv = make_kv_cache_manager(config, self.runner, static, lookahead)
        self.kv.drop_last_hit = spec is not None and spec.uses_hidden_states
        self.connector = make_connector(config.kv_transfer_config)  # the scheduler side of P/D's KV hand-off
        if self.connector is not None:
            self.connector.set_xfer_handshake_metadata(self.runner.kv_connector.get_handshake_metadata())
        self.scheduler = Scheduler(config, self.kv, self.connector)
        self.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, config.hf_config.vocab_size,
                                                         self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_prompt_tokens = self.num_generation_tokens = self.num_finished_requests = 0
        shape = self.runner.expert_load_shape
        self.expert_load = torch.zeros(shape, dtype=torch.long) if shape else None
        self.proposer = make_proposer(spec, self.runner.drafter)
        self.spec_switch = make_switch(config.speculative_config)
        self._proposal_s = 0.0  # time the last step spent drafting
        self.spec_decode_stats = SpecDecodeStats()
        self.kv_events = make_publisher(config.kv_events_config, self.kv)
        freeze_startup_heap()  # as vLLM's EngineCore, offline too: a full collection walked it all (~100 ms)

    def _publish_kv_events(self):
        if self.kv_events is not None:
            self.kv_events.publish(time.time(), self.kv.events.take())

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        """EngineConfig's fields and vLLM's engine arguments (engine_args.py)."""
        return cls(engine_config(model, **kwargs))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """prompt: text, token ids, or a dict with "prompt" / "prompt_token_ids" and optional "cache_salt"
        (requests with different salts never share cached KV blocks). BeamSearchParams run beam search:
        the beams are forks of one sequence, sharing blocks copy-on-write."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam:
            params = SamplingParams(temperature=0, max_tokens=beam.max_tokens, ignore_eos=beam.ignore_eos,
                                    logprobs=2 * beam.beam_width)
        self._check_params(params, beam)
        text, token_ids = self._tokenize(prompt)
        token_ids = _truncated(token_ids, params.truncate_prompt_tokens, self.config.max_model_len)
        params = self._check_lengths(token_ids, params)
        request = Request(request_id, text, token_ids, params, arrival_time, cache_salt)
        request.beam = beam
        request.eos_token_ids = set() if params.ignore_eos else self.eos_token_ids
        request.bad_words_token_ids = bad_words_token_ids(params, self.tokenizer)
        seq = Sequence(next(self._seq_ids), request, list(token_ids))
        seq.grammar = self.structured_output.grammar_for(params)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def pooling_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None) -> list[int]:
        """The token ids LLM.embed pools: tokenized and truncated as a generation request's prompt."""
        token_ids = _truncated(self._tokenize(prompt)[1], truncate_prompt_tokens, self.config.max_model_len)
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, more than max_model_len "
                             f"({self.config.max_model_len}); truncate_prompt_tokens can shorten it")
        return token_ids

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(list(prompt["prompt_token_ids"]))
            prompt = prompt.get("prompt")
        if isinstance(prompt, list):
            return None, self._check_token_ids(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True); pass prompt_token_ids")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, self.tokenizer(prompt).input_ids

    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("prompt must not be empty (no prompt_token_ids)")
        vocab = self.config.hf_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        return token_ids

    def _check_params(self, params: SamplingParams, beam: BeamSearchParams | None):
        """What only the engine knows: the vocab, max_logprobs, max_num_seqs."""
        vocab, cfg = self.config.hf_config.vocab_size, self.config
        max_logprobs = vocab if cfg.max_logprobs < 0 else min(cfg.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if beam is None and value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be <= {max_logprobs} (max_logprobs), got {value}")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
        check_token_params(params, vocab)
        if beam is not None and params.structured_outputs is not None:
            raise ValueError("structured_outputs cannot be combined with beam search")
        num_samples = beam.beam_width if beam else params.num_samples
        limit = min(cfg.max_num_seqs, vocab // 2) if beam else cfg.max_num_seqs
        if num_samples > limit:
            name = "beam_width" if beam else "best_of" if params.best_of else "n"
            raise ValueError(f"{name} must be <= {limit} (max_num_seqs), got {num_samples}")

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, max_model_len is {max_len}: "
                             "it leaves no room for output")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"max_tokens: the prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"is more than max_model_len ({max_len})")
        if params.max_tokens is None:
            params = _replace(params, max_tokens=max_len - len(token_ids))
        num_tokens = len(token_ids) + max(params.max_tokens, self._num_reserved_outputs(params))
        num_blocks = self.kv.num_blocks_for(min(num_tokens, max_len))
        if num_blocks > self.kv.capacity_blocks:
            raise ValueError(f"prompt + max_tokens = {num_tokens} tokens need "
                             f"{num_blocks} KV blocks; the pool has {self.kv.capacity_blocks}")
        return params

    def _num_reserved_outputs(self, params: SamplingParams) -> int:
        if self.config.kv_allocation != "static":
            return 0
        return self.config.static_reserve_tokens or params.max_tokens

    def _static_reserve(self, seq: Sequence) -> int:
        reserved = seq.num_prompt_tokens + self._num_reserved_outputs(seq.params)
        return max(min(reserved, self.config.max_model_len), len(seq))

    def abort_request(self, request_id: str):
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def shutdown(self):
        """Stops the other ranks of a multi-process engine and the KV event publisher, if any."""
        self.runner.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        failed = self._update_kv_transfers()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting_for_remote_kvs:
                time.sleep(0.0005)  # only remote reads in flight (NIXL moves them): no busy loop on the core
            return failed
        outputs = failed + self._run_step(sched)
        self._publish_kv_events()  # the blocks this step wrote are stored now
        return outputs

    def _run_step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        start, num_generated = time.perf_counter(), self.num_generation_tokens
        kind = decode_step_kind(sched) if self.spec_switch is not None else None
        failed = self._drop_failed_loads(sched, self.runner.apply_transfers(sched))
        if not sched.seqs:
            return failed
        try:
            out = self.runner.execute(sched)
        except Exception as error:
            if is_fatal(error):
                raise
            return failed + self._step_each_request(sched, error)
        outputs = failed + self._postprocess(sched, out)
        if kind is not None:
            self.spec_switch.record(len(sched.seqs), kind, time.perf_counter() - start,
                                    self.num_generation_tokens - num_generated, self._proposal_s)
        return outputs

    def _update_kv_transfers(self) -> list[RequestOutput]:
        """An async KV connector's transfers finished since the last step (reads done, leases released)."""
        if self.connector is None:
            return []
        return self._fail_loads(self.scheduler.update_connector_output(self.runner.kv_connector.get_finished()))

    def _drop_failed_loads(self, sched: SchedulerOutput, failed_loads: dict) -> list[RequestOutput]:
        """Requests whose remote KV did not load fail with that error; the rest of the step goes on without them."""
        keep = [i for i, seq in enumerate(sched.seqs) if seq.request.request_id not in failed_loads]
        sched.seqs, sched.num_new_tokens = [sched.seqs[i] for i in keep], [sched.num_new_tokens[i] for i in keep]
        return self._fail_loads(failed_loads)

    def _fail_loads(self, failed_loads: dict) -> list[RequestOutput]:
        """A request whose remote KV did not load fails, unless kv_load_failure_policy is "recompute"."""
        failed_loads = self.scheduler.recompute_failed_loads(failed_loads)
        failed = {rid: (self.requests[rid], error) for rid, error in failed_loads.items() if rid in self.requests}
        self._fail(failed)
        return [self._make_output(request, time.time()) for request, _ in failed.values()]

    def _step_each_request(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A failed step runs again one request at a time: a request that fails alone gets an error output,
        the others go on. When every request fails alone, no request explains the error: it is raised."""
        parts, failed, outputs = split_by_request(sched), {}, []
        if len(parts) == 1:  # alone already: the error is this request's
            failed[parts[0][0].request_id] = (parts[0][0], error)
        else:
            for request, part in parts:
                with failures_into(failed, request):
                    outputs += self._postprocess(part, self.runner.execute(part))
        if len(parts) > 1 and len(failed) == len(parts):
            raise EngineStepError(f"every request of the step failed alone; first: {describe(error)}") from error
        self._fail(failed)
        return outputs + self._outputs([request for request, _ in failed.values()], time.time())

    def _fail(self, failed: dict):
        """Finishes the failed requests with finish_reason "error"; their blocks are freed and those not
        written leave the prefix cache."""
        for request, error in failed.values():
            logger.error("request %s failed: %s", request.request_id, describe(error), exc_info=error)
            request.error, request.bad_input = describe(error), is_bad_input(error)
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq, failed=True)

    def _postprocess(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        now = time.time()
        for seq, num_new in zip(sched.seqs, sched.num_new_tokens):
            seq.num_computed_tokens += num_new
            seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now
            self.num_prompt_tokens += max(min(seq.num_computed_tokens, seq.num_prompt_tokens)
                                          - (seq.num_computed_tokens - num_new), 0)
        if out.expert_load is not None:
            self.expert_load += out.expert_load.cpu()
        self._append_prompt_logprobs(sched, out)
        if out.hidden_states is not None:
            self.proposer.stash_hidden(sched.seqs, sched.num_new_tokens, out.hidden_states)
        touched = self._append_samples(out, now)
        if self.proposer is not None:
            start = time.perf_counter()
            self._propose_drafts(touched)
            self._proposal_s = time.perf_counter() - start
        return self._outputs(touched, now)

    def _propose_drafts(self, requests: list[Request]):
        """Draft tokens for every running sequence whose next step is a decode, unless the batch is past
        speculative_config.disable_by_batch_size or, adaptive, measured slower with drafts at its size."""
        limit, batch_size = self.config.speculative_config.disable_by_batch_size, len(self.scheduler.running)
        if limit is not None and batch_size > limit or \
                self.spec_switch is not None and not self.spec_switch.should_speculate(batch_size):
            for seq in (s for request in requests for s in request.seqs):
                seq.drafts_paused = True
            return
        seqs = [s for request in requests for s in request.seqs if self._can_draft(s)]
        ks = [max_draft_tokens(s, self.config.speculative_config.num_speculative_tokens, self.config.max_model_len)
              for s in seqs]
        seqs, ks = [s for s, k in zip(seqs, ks) if k], [k for k in ks if k]
        for seq, (token_ids, probs) in zip(seqs, self.proposer.propose(seqs, ks) if seqs else []):
            seq.spec_token_ids, seq.spec_draft_probs = token_ids, probs

    def _can_draft(self, seq: Sequence) -> bool:
        """A running sequence whose next step is a decode; with a draft model, not while its last block is
        shared (a fork's first step: the draft would write its own token into its siblings' block)."""
        if seq.status != SequenceStatus.RUNNING or len(seq) != seq.num_computed_tokens + 1 or not can_speculate(seq):
            return False
        if not self.config.speculative_config.uses_draft_kv:
            return True
        return not self.kv.pool.is_shared(seq.block_table[(len(seq) - 1) // self.config.block_size])

    def _append_prompt_logprobs(self, sched: SchedulerOutput, out: ModelRunnerOutput):
        for seq in sched.seqs:
            if seq.seq_id not in out.prompt_logprobs:
                continue
            start, logprobs, token_ids = out.prompt_logprobs[seq.seq_id]
            entries = seq.request.prompt_logprobs
            for pos in range(len(entries), start + len(token_ids)):
                row = pos - start
                entries.append(_logprob_dict(logprobs[row], int(token_ids[row]), seq.params.prompt_logprobs,
                                             self._detokenizing(seq)))

    def _append_samples(self, out: ModelRunnerOutput, now: float) -> list[Request]:
        """Each sequence's rows; an error in one request's part fails that request alone."""
        sampled, token_ids = out.sampled, out.sampled.token_ids.tolist()
        row, touched, failed = 0, {}, {}
        for seq, num_samples in zip(out.sample_seqs, out.num_samples):
            num_rows = 1 if seq.request.beam is not None else num_samples + len(seq.spec_token_ids)
            with failures_into(failed, seq.request):
                self._append_rows(seq, num_samples, sampled, token_ids, row)
            row += num_rows
            touched[seq.request.request_id] = seq.request
            seq.request.metrics.first_token_time = seq.request.metrics.first_token_time or now
            seq.request.metrics.last_token_time = now
        for request in touched.values():
            with failures_into(failed, request):
                if request.beam is not None and request.request_id not in failed:
                    self._step_beams(request)
        self._fail(failed)
        return list(touched.values())

    def _append_rows(self, seq: Sequence, num_samples: int, sampled, token_ids: list[int], row: int):
        if seq.request.beam is not None:
            seq.beam_candidates = _beam_candidates(seq, sampled, row)
            return
        if seq.spec_token_ids:
            return self._append_verified(seq, sampled, token_ids, row)
        for offset, s in enumerate([seq] + self._fork(seq, num_samples)):
            self._append_token(s, token_ids[row + offset], sampled, row + offset)

    def _append_verified(self, seq: Sequence, sampled, token_ids: list[int], row: int):
        """A speculating sequence's rows: the accepted drafts and the draw after them, one token at a time
        through the stop checks; the rejected drafts' positions are rolled back (their KV is overwritten)."""
        drafts, seq.spec_token_ids, seq.spec_draft_probs = seq.spec_token_ids, [], None
        accepted = num_accepted(drafts, token_ids[row:row + len(drafts) + 1])
        seq.num_computed_tokens -= len(drafts) - accepted
        seq.num_drafter_tokens = min(seq.num_drafter_tokens, len(seq) + accepted)  # the draft KV still right
        seq.keep_hidden(seq.num_computed_tokens - seq.num_drafter_tokens)  # none at rejected positions
        self.spec_decode_stats.record(len(drafts), accepted)
        for offset in range(accepted + 1):
            self._append_token(seq, token_ids[row + offset], sampled, row + offset)
            if seq.finish_reason is not None:
                return

    def _step_beams(self, request: Request):
        live = [s for s in request.seqs if not s.is_finished]
        if any(s.beam_candidates is None for s in live):
            return
        candidates = [dataclasses.replace(c, beam_index=i) for i, s in enumerate(live) for c in s.beam_candidates]
        chosen, finished = select_beams(candidates, request.beam.beam_width, request.eos_token_ids)
        for cand in finished:
            request.finished_beams.append(self._finished_beam(live[cand.beam_index], cand))
        new_beams = self._extend_beams(live, chosen)
        for seq in live:
            seq.beam_candidates = None
            if seq not in new_beams:
                self.scheduler.finish(seq)
        request.seqs = [s for s in request.seqs if s in new_beams or s.finish_reason == "length"]

    def _extend_beams(self, live: list[Sequence], chosen: list[BeamCandidate]) -> list[Sequence]:
        new_beams = []
        for index, seq in enumerate(live):
            mine = [c for c in chosen if c.beam_index == index]
            forks = self._fork(seq, len(mine)) if mine else []
            for beam, cand in zip([seq] + forks, mine):
                beam.beam_candidates = None
                self._append_beam_token(beam, cand)
                new_beams.append(beam)
        return new_beams

    def _append_beam_token(self, seq: Sequence, cand: BeamCandidate):
        seq.token_ids.append(cand.token_id)
        seq.cumulative_logprob = cand.score
        self.num_generation_tokens += 1
        self.detokenizer.append(seq, cand.token_id)
        if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.config.max_model_len:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)

    def _finished_beam(self, parent: Sequence, cand: BeamCandidate) -> Sequence:
        beam = Sequence(next(self._seq_ids), parent.request, parent.token_ids + [cand.token_id])
        beam.cumulative_logprob, beam.output_text, beam.finish_reason = cand.score, parent.output_text, "stop"
        return beam

    def _fork(self, parent: Sequence, num_samples: int) -> list[Sequence]:
        children = [parent.fork(next(self._seq_ids), i) for i in range(1, num_samples)]
        self.scheduler.add_forks(parent, children)
        parent.request.seqs.extend(children)
        return children

    def _append_token(self, seq: Sequence, token_id: int, sampled, row: int):
        seq.token_ids.append(token_id)
        self.num_generation_tokens += 1
        if sampled.logprobs is not None:
            seq.cumulative_logprob += float(sampled.logprobs[row])
            if seq.logprobs is not None:
                seq.logprobs.append(self._sample_logprobs(seq, token_id, sampled, row))
        text = self.detokenizer.append(seq, token_id)
        self._check_stop(seq, token_id, text)
        if seq.grammar is not None:
            _advance_grammar(seq, token_id)
        if seq.finish_reason is not None:
            self._hand_off_kv(seq)
            self.scheduler.finish(seq)

    def _hand_off_kv(self, seq: Sequence):
        """A prefill instance's finished do_remote_decode request: its prompt KV saved (before the blocks are
        freed) and the kv_transfer_params the decode instance is given."""
        if self.connector is None or seq.finish_reason in ("abort", "error"):
            return
        params, save = self.connector.request_finished(seq)
        if save is not None:
            self.runner.save_kv(save)
        if params is not None:
            seq.request.kv_transfer_params_out = params

    def _sample_logprobs(self, seq: Sequence, token_id: int, sampled, row: int) -> dict[int, Logprob]:
        entry = {token_id: Logprob(float(sampled.logprobs[row]), int(sampled.ranks[row]))}
        num_top = seq.params.logprobs
        if num_top:
            ids, values = sampled.top_ids[row, :num_top].tolist(), sampled.top_logprobs[row, :num_top].tolist()
            for rank, (tid, value) in enumerate(zip(ids, values), start=1):
                entry.setdefault(tid, Logprob(value, rank))
        _decode_logprobs(entry, self._detokenizing(seq))
        return entry

    def _detokenizing(self, seq: Sequence):
        """The tokenizer, or None where the request asked for token ids only (detokenize=False)."""
        return self.tokenizer if seq.params.detokenize else None

    def _check_stop(self, seq: Sequence, token_id: int, new_text: str):
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token_id
                return
            if token_id in seq.request.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if params.stop_strings and self._truncate_at_stop(seq, len(new_text)):
                return
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len:
            seq.finish_reason = "length"

    def _truncate_at_stop(self, seq: Sequence, num_new_chars: int) -> bool:
        params = seq.params
        for stop in params.stop_strings:
            begin = max(len(seq.output_text) - num_new_chars - len(stop) + 1, 0)
            index = seq.output_text.find(stop, begin)
            if index >= 0:
                end = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _outputs(self, requests: list[Request], now: float) -> list[RequestOutput]:
        return [as_output_kind(r, self._make_output(r, now)) for r in requests if wants_output(r)]

    def _make_output(self, request: Request, now: float) -> RequestOutput:
        finished = request.is_finished
        if finished:
            request.metrics.finished_time = now
            self.requests.pop(request.request_id, None)
            self.num_finished_requests += 1
        with_logprobs = request.params.logprobs is not None  # as vLLM: no cumulative_logprob without them
        outputs = [CompletionOutput(i, s.output_text, s.output_token_ids,
                                    s.cumulative_logprob if with_logprobs else None, s.logprobs,
                                    s.finish_reason, s.stop_reason)
                   for i, s in enumerate(_ranked_seqs(request, finished))]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             request.prompt_logprobs, outputs, finished, request.metrics,
                             request.num_cached_tokens or 0, request.error, request.kv_transfer_params_out,
                             request.bad_input)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forgets every cached block not in use; True when no block was in use (the cache is empty)."""
        empty = self.kv.reset_prefix_cache()
        self._publish_kv_events()
        return empty

    def get_stats(self) -> EngineStats:
        pool, sched = self.kv.pool, self.scheduler
        return EngineStats(len(sched.running), len(sched.waiting), len(sched.swapped), pool.num_blocks,
                           pool.num_used_blocks, pool.num_free_blocks, sched.num_preemptions["recompute"],
                           sched.num_preemptions["swap"], self.num_prompt_tokens, self.num_generation_tokens,
                           self.num_finished_requests, self.kv.num_queried_tokens,
                           sum(self.kv.num_hit_tokens.values()), dict(self.kv.num_hit_tokens),
                           self.kv.num_offloaded_blocks, self.kv.num_spilled_blocks,
                           [] if self.expert_load is None else self.expert_load.tolist(),
                           self.spec_decode_stats.copy() if self.proposer is not None else None,
                           self.runner.parallel_stats(self.expert_load), self.runner.expert_cache_stats())


def _advance_grammar(seq: Sequence, token_id: int):
    """The sampler only draws tokens the grammar allows; once it has ended (its stop token), so does the
    sequence, even with ignore_eos."""
    if not seq.grammar.accept(token_id):
        raise ValueError(f"structured_outputs: token {token_id} is not allowed by the grammar")
    if seq.grammar.is_terminated and seq.finish_reason is None:
        seq.finish_reason = "stop"


def _ranked_seqs(request: Request, finished: bool) -> list[Sequence]:
    """Samples in order; best_of keeps the n with the highest cumulative logprob once finished; beam search
    ranks finished hypotheses and beams by length-penalised score."""
    if request.beam is not None:
        seqs = request.finished_beams + request.seqs
        penalty = request.beam.length_penalty
        ranked = sorted(seqs, key=lambda s: -beam_score(s.cumulative_logprob, s.num_output_tokens, penalty))
        return ranked[:request.beam.beam_width]
    seqs = sorted(request.seqs, key=lambda s: s.sample_index)
    if finished and request.params.num_samples > request.params.n:
        seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)
    return seqs[:request.params.n]


def _beam_candidates(seq: Sequence, sampled, row: int) -> list[BeamCandidate]:
    ids, values = sampled.top_ids[row].tolist(), sampled.top_logprobs[row].tolist()
    return [BeamCandidate(seq.cumulative_logprob + v, -1, t, v) for t, v in zip(ids, values)]


def _truncated(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """SamplingParams.truncate_prompt_tokens: the last `keep` prompt tokens (-1: max_model_len)."""
    if keep is None:
        return token_ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({keep}) must be <= max_model_len ({max_model_len})")
    return token_ids[-(max_model_len if keep == -1 else keep):]


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    values = {f.name: getattr(params, f.name) for f in fields(params) if f.init}
    return SamplingParams(**{**values, **changes})


def _eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    ids = set()
    for source in (config.hf_config, _generation_config(config.model), tokenizer):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids


def _generation_config(model_dir: str):
    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        return None
    return GenerationConfig.from_pretrained(model_dir)


def _logprob_dict(logprobs, token_id: int, num_top: int, tokenizer) -> dict[int, Logprob]:
    value = logprobs[token_id]
    entry = {token_id: Logprob(float(value), int((logprobs > value).sum()) + 1)}
    if num_top:
        top_values, top_ids = logprobs.topk(num_top)
        for rank, (tid, v) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1):
            entry.setdefault(tid, Logprob(v, rank))
    _decode_logprobs(entry, tokenizer)
    return entry


def _decode_logprobs(entry: dict[int, Logprob], tokenizer):
    if tokenizer is not None:
        for tid, logprob in entry.items():
            logprob.decoded_token = tokenizer.decode([tid])
