"""An EAGLE-3 draft head (vLLM's llama_eagle3 layout, EAGLE-3's checkpoint names): one decoder layer over the
target's embeddings and LM head. The target's hidden states entering three of its layers (low, middle, high:
`eagle_aux_hidden_state_layer_ids` in the head's config; index L is the final, normed hidden state) are fused
by fc (3h -> h); entry j takes token j + 1 and the fused state at position j and predicts token j + 2. The
layer's attention reads [input_layernorm(embed(token)); hidden_norm(hidden)] (2h wide), its residual carries
the hidden state; its pre-norm output is the hidden state of the next draft, and norm + the target's LM head give the logits.
Runs through the MTP proposer's bookkeeping (mtp.py): same entries, KV in the target's blocks."""
import torch
from torch import nn
from transformers import AutoConfig

from pagedmoe.layers.linear import Linear, MergedLinear
from pagedmoe.layers.norm import RMSNorm
from pagedmoe.models.llama import MLP, STACKED_PARAMS, Attention, _copy_param, head_dim_of
from pagedmoe.layers.rotary import RotaryEmbedding, rope_inv_freq
from pagedmoe.spec_decode.draft_model import CATCH_UP_ROWS, MIN_CATCH_UP, DraftInputs, skip_behind
from pagedmoe.spec_decode.fused_drafters import MAX_ROWS, FusedEagleStep
from pagedmoe.spec_decode.mtp import MTPProposer
from pagedmoe.worker.inputs import pad_block_tables
from pagedmoe.worker.model_loader import finish_model, load_weights, num_weight_elements

ARCHITECTURE = "LlamaForCausalLMEagle3"
MAX_STASHED_STEPS = 64  # a sequence that drafted in none of its last this many steps keeps KEPT_ROWS rows


def vllm_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default for heads whose config names none: the inputs of layers 2, L // 2 and L - 3."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int]:
    """The heads pagedmoe trains: the inputs of layers 1 and L // 2, and the final hidden state (index L, as
    HF's hidden_states[L]: after the final norm), which on a shallow target carries most of the next token."""
    return sorted({1 % num_layers, num_layers // 2, num_layers})


class Eagle3Head(nn.Module):
    def __init__(self, config, target: nn.Module):
        super().__init__()
        hidden, self.hidden_size = config.hidden_size, config.hidden_size
        self.aux_layers = tuple(getattr(config, "eagle_aux_hidden_state_layer_ids", None)
                                or vllm_aux_layers(target.config.num_hidden_layers))
        self.fc = Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        inv_freq, scaling = rope_inv_freq(config, head_dim_of(config))
        self.self_attn = Attention(config, 0, RotaryEmbedding(inv_freq, scaling, config.max_position_embeddings), None)
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
        self.self_attn.qkv_proj = MergedLinear(2 * hidden, {"q": heads * head_dim, "k": kv_heads * head_dim,
                                                            "v": kv_heads * head_dim})
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = MLP(hidden, config.intermediate_size)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.target = [target]  # its embeddings and LM head, frozen (a list: not a submodule of the head)
        self.config = config

    def kv_cache_token_shape(self) -> tuple[int, tuple[int, ...]]:
        return 2 * self.config.num_key_value_heads, (head_dim_of(self.config),)

    def forward(self, input_ids, hidden, positions, meta) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:  # the target's fused states; later drafts pass the head's own
            hidden = self.fc(hidden)
        embeds = self.input_layernorm(self.target[0].embed_tokens(input_ids))
        x = hidden + self.self_attn(positions, torch.cat([embeds, self.hidden_norm(hidden)], dim=-1), meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(self.norm(hidden))

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        parts = name.removeprefix("midlayer.").split(".")
        if len(parts) >= 2 and parts[-2] in STACKED_PARAMS:
            module, shard = STACKED_PARAMS[parts[-2]]
            self.get_submodule(".".join(parts[:-2] + [module])).load_shard(shard, parts[-1], tensor)
            return True
        return _copy_param(self, ".".join(parts), tensor)


def load_eagle3(config, spec, target: nn.Module) -> Eagle3Head:
    head_config = AutoConfig.from_pretrained(spec.model, trust_remote_code=False)
    if ARCHITECTURE not in (getattr(head_config, "architectures", None) or []):
        raise ValueError(f"speculative_config.model: {spec.model!r} is not an EAGLE-3 head ({ARCHITECTURE})")
    if head_config.hidden_size != config.hf_config.hidden_size:
        raise ValueError(f"speculative_config.model: the head's hidden_size ({head_config.hidden_size}) is not "
                         f"the target's ({config.hf_config.hidden_size})")
    with torch.device(config.device):
        head = Eagle3Head(head_config, target)
    num_loaded, num_expected = load_weights(head, spec.model), num_weight_elements(head)
    if num_loaded != num_expected:
        raise ValueError(f"speculative_config.model: {spec.model!r} filled {num_loaded} of the head's "
                         f"{num_expected} weight elements")
    return head.to(dtype=config.torch_dtype).eval()


class Eagle3Proposer(MTPProposer):
    def __init__(self, config, spec, target: nn.Module):
        self.spec, self.config = spec, config
        self.model = finish_model(load_eagle3(config, spec, target), config)
        self.aux_layers = self.model.aux_layers
        self.fused = FusedEagleStep.of(self.model)
        self.setup(config)

    def propose(self, seqs: list, ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Greedy drafts of every step in one kernel call where it applies, else step by step (draft_model.py)."""
        ks = self.capped(seqs, ks)
        live = [i for i, k in enumerate(ks) if k]
        live_seqs = [seqs[i] for i in live]
        self._skip_far_behind(live_seqs)
        if not live or not self._fuses(live_seqs) or not self._drafts_greedily(live_seqs):
            return super().propose(seqs, ks)
        inputs, tables = self.first_inputs(live_seqs), pad_block_tables([seq.block_table for seq in live_seqs])
        _, _, drafts = self.fused(self.kv_cache.device_cache[0], inputs.token_lists, inputs.starts, inputs.hidden,
                                  tables, [ks[i] for i in live], [seq.drafter_start for seq in live_seqs])
        return self.take_drafts(seqs, live, drafts, [0] * len(live))

    def _skip_far_behind(self, seqs):
        """Where the head's KV is far behind (drafting was off, or a batch of new prompts), it catches up over
        the last positions only, CATCH_UP_ROWS for the proposal in all (at least MIN_CATCH_UP a sequence), and
        attends from there on: the catch-up over every sequence's whole context made turning speculation on
        at batch 64 cost ~100 ms. Drafts only: verification keeps the output exact."""
        if not seqs or not self._can_fuse():
            return
        limit = max(MIN_CATCH_UP, CATCH_UP_ROWS // len(seqs))
        for seq in seqs:
            skip_behind(seq, limit)

    def max_stashed_steps(self) -> int | None:
        """While speculation is off (at batch 64) a sequence's stash grew by a view a step until it finished,
        which cost ~6% of each step's time: one that has not drafted for MAX_STASHED_STEPS steps keeps the
        KEPT_ROWS rows a catch-up would read at large batches (only the kernel attends past skipped positions)."""
        return MAX_STASHED_STEPS if self._can_fuse() else None

    def step_ks(self, seqs, ks: list[int]) -> list[int]:
        return ks  # its steps attend from each sequence's first position (_step)

    def _can_fuse(self) -> bool:
        return self.fused is not None and self.fused.fits(self.kv_cache.device_cache[0])

    def _fuses(self, seqs) -> bool:
        """The kernel for few rows, and always for a sequence that attends from a later position (which the
        head's modules cannot)."""
        num_rows = sum(max(seq.num_computed_tokens - seq.num_drafter_tokens, 1) for seq in seqs)
        return self._can_fuse() and (num_rows <= MAX_ROWS or any(seq.drafter_start for seq in seqs))

    def _step(self, seqs, inputs: DraftInputs, tables: torch.Tensor) -> tuple[list[int], list, torch.Tensor]:
        """One step as one kernel call where it applies (sampled drafts), else through the head's modules."""
        if not self._fuses(seqs):
            return super()._step(seqs, inputs, tables)
        hidden, logits, _ = self.fused(self.kv_cache.device_cache[0], inputs.token_lists, inputs.starts,
                                       inputs.hidden, tables, firsts=[seq.drafter_start for seq in seqs])
        return *self._choose(logits, seqs), hidden
