"""Data-parallel attention (as vLLM and SGLang run DeepSeek): every rank holds the whole attention and dense
weights and attends only its own sequences (their KV lives in its own pool); MoE layers gather every rank's
tokens, each rank computes its experts' part for all of them (expert parallel), one all-reduce sums the
parts, and each rank keeps its own rows. A rank with no sequence in a step runs one dummy token, because the
MoE layers' collectives need every rank."""
from dataclasses import dataclass

import torch
from torch import nn

from pagedmoe.distributed import parallel_state as ps
from pagedmoe.distributed.eplb import initial_placement
from pagedmoe.distributed.tensor_parallel import shard_experts


@dataclass
class DataParallelPlan:
    plans: list  # one StepPlan per rank, None for a rank without sequences this step


class TokenExchange:
    """The MoE layer's all-gather of the ranks' tokens and the return of each rank's rows."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        self.counts = [int(n) for n in ps.all_gather_list(torch.tensor([x.shape[0]]))]
        padded = x.new_zeros(max(self.counts), x.shape[1])
        padded[:x.shape[0]] = x
        return torch.cat([part[:n] for part, n in zip(ps.all_gather_list(padded), self.counts)])

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        ps.all_reduce(out)
        start = sum(self.counts[:ps.rank()])
        return out[start:start + self.counts[ps.rank()]]


def shard_model_dp(model: nn.Module, info: ps.RankInfo, expert_parallel: bool, num_redundant: int) -> nn.Module:
    """Attention and dense layers whole on every rank; MoE experts whole and spread over the ranks."""
    moe_layers = getattr(model, "moe_layers", [])
    if moe_layers and not expert_parallel:
        raise ValueError("data_parallel_size > 1 with an MoE model needs enable_expert_parallel")
    for moe in moe_layers:
        shard_experts(moe, info, initial_placement(1, moe.num_experts, info.world_size, num_redundant)[0],
                      shared=False)
        moe.token_exchange = TokenExchange()
    return model


def split_by_rank(sched, ends: list[int], num_ranks: int) -> list[tuple]:
    """The step's sequences by the rank holding their KV, as (SchedulerOutput, ends) per rank."""
    from pagedmoe.engine.kv_cache_manager import BlockTransfers
    from pagedmoe.engine.scheduler import SchedulerOutput
    parts = [(SchedulerOutput([], [], BlockTransfers()), []) for _ in range(num_ranks)]
    for seq, num_new, end in zip(sched.seqs, sched.num_new_tokens, ends):
        part, part_ends = parts[seq.dp_rank]
        part.seqs.append(seq)
        part.num_new_tokens.append(num_new)
        part_ends.append(end)
    return parts


def merge_logits(sched, ends: list[int], by_rank: list[list[torch.Tensor]], prompt_seqs_by_rank: list[list],
                 prompt_rows: list) -> list[torch.Tensor]:
    """Each rank's [sampled rows, prompt-logprob rows per sequence] back in schedule order: the sampled rows
    of every sampling sequence as one tensor, then prompt_rows' sequences' logits."""
    cursors, sampled = [0] * len(by_rank), []
    for seq, end in zip(sched.seqs, ends):
        if end == len(seq) + len(seq.spec_token_ids):
            rank, num_rows = seq.dp_rank, 1 + len(seq.spec_token_ids)
            sampled.append(by_rank[rank][0][cursors[rank]:cursors[rank] + num_rows])
            cursors[rank] += num_rows
    by_seq = {seq.seq_id: logits for seqs, outs in zip(prompt_seqs_by_rank, by_rank)
              for seq, logits in zip(seqs, outs[1:])}
    vocab = next(outs[0].shape[-1] for outs in by_rank if outs)
    sample_logits = torch.cat(sampled) if sampled else torch.empty(0, vocab)
    return [sample_logits] + [by_seq[seq.seq_id] for seq, _ in prompt_rows]
