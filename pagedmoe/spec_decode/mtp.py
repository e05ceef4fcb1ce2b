"""DeepSeek-V3 multi-token prediction as the proposer: the checkpoint's extra layer model.layers.{L}
(L = num_hidden_layers; enorm, hnorm, eh_proj, a decoder block, shared_head) drafts from the target's final
hidden states. Entry j combines token j + 1 with the target's hidden state at position j and predicts token
j + 2 (as vLLM's deepseek_mtp): h = eh_proj([enorm(embed(t_j+1)); hnorm(h_j)]), the block at position j,
logits = shared_head.head(shared_head.norm(h)). Its KV (MLA, one layer) lives in the target's blocks like a
draft model's; seq.num_drafter_tokens counts the entries built from the target's own hidden states, and
seq.spec_hidden holds the target's hidden states of the positions computed since. Later drafts feed the
block's own output back in place of the target's hidden state, and the one layer is reused for every draft."""
import copy

import torch
from safetensors import safe_open
from torch import nn

from pagedmoe.layers.linear import Linear
from pagedmoe.layers.norm import RMSNorm
from pagedmoe.models.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from pagedmoe.models.llama import _copy_param
from pagedmoe.spec_decode.draft_model import (KEPT_ROWS, DraftInputs, DraftModelProposer, can_speculate,
                                              skip_behind)
from pagedmoe.worker.model_loader import finish_model, num_weight_elements, weight_files

OWN_WEIGHTS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "norm",
               "shared_head.head": "lm_head", "embed_tokens": "embed_tokens"}  # MTP name -> module here
TARGET_FALLBACKS = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


class DeepseekMTP(DeepseekV3ForCausalLM):
    """One decoder block (the checkpoint's layer L, at KV layer 0 of its own storage) with its input
    projections; embed_tokens, norm and lm_head hold the layer's embed_tokens and shared_head."""

    def __init__(self, config):
        self.mtp_layer = config.num_hidden_layers
        config = copy.deepcopy(config)
        config.num_hidden_layers, config.tie_word_embeddings = 1, False
        super().__init__(config)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)

    def make_layer(self, config, layer_idx: int, rotary) -> nn.Module:
        return DeepseekDecoderLayer(config, 0, rotary, self.make_mlp(config, self.mtp_layer))

    def forward(self, input_ids, hidden, positions, meta) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.layers[0](positions, x, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def load_mtp_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """A checkpoint name of the MTP layer (model.layers.{L}.*), or False for any other."""
        prefix = f"model.layers.{self.mtp_layer}."
        if not name.startswith(prefix):
            return False
        rest = name.removeprefix(prefix)
        module, _, param = rest.rpartition(".")
        if module in OWN_WEIGHTS:
            return _copy_param(self, f"{OWN_WEIGHTS[module]}.{param}", tensor)
        return self.load_weight(f"model.layers.0.{rest}", tensor)


def load_mtp(config) -> DeepseekMTP:
    """The MTP layer of the target's checkpoint; its embed_tokens and head default to the target's."""
    hf = config.hf_config
    if "DeepseekV3ForCausalLM" not in (hf.architectures or []) or not getattr(hf, "num_nextn_predict_layers", 0):
        raise ValueError("speculative_config.method 'mtp' needs a DeepSeek-V3 checkpoint with "
                         "num_nextn_predict_layers >= 1")
    with torch.device(config.device):
        model = DeepseekMTP(hf)
    loaded, fallbacks, num_loaded = set(), {}, 0
    for path in weight_files(config.model):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in TARGET_FALLBACKS:
                    fallbacks[TARGET_FALLBACKS[name]] = (path, name)
                elif model.load_mtp_weight(name, tensor := f.get_tensor(name)):
                    loaded.add(name)
                    num_loaded += tensor.numel()
    num_loaded += _load_fallbacks(model, loaded, fallbacks)
    num_expected = num_weight_elements(model)
    if num_loaded != num_expected:
        raise ValueError(f"speculative_config.method 'mtp': the checkpoint's model.layers.{hf.num_hidden_layers}.* "
                         f"filled {num_loaded} of the MTP layer's {num_expected} weight elements in {config.model!r}")
    return model.to(dtype=config.torch_dtype).eval()


def _load_fallbacks(model: DeepseekMTP, loaded: set[str], fallbacks: dict) -> int:
    """The target's embed_tokens and lm_head where the MTP layer has none of its own; elements loaded."""
    prefix, num_loaded = f"model.layers.{model.mtp_layer}.", 0
    own = {f"{OWN_WEIGHTS[m]}.weight" for m in OWN_WEIGHTS if f"{prefix}{m}.weight" in loaded}
    for param, (path, name) in fallbacks.items():
        if param not in own:
            with safe_open(path, framework="pt") as f:
                num_loaded += _copy_param(model, param, tensor := f.get_tensor(name)) and tensor.numel()
    return num_loaded


class MTPProposer(DraftModelProposer):
    uses_hidden_states = True

    def __init__(self, config, spec):
        self.spec, self.config = spec, config
        self.model = finish_model(load_mtp(config), config)
        self.setup(config)

    @property
    def num_layers(self) -> int:
        return 1

    def first_inputs(self, seqs) -> DraftInputs:
        """Entries num_drafter_tokens .. num_computed_tokens - 1 from the target's hidden states."""
        tokens = [seq.token_ids[seq.num_drafter_tokens + 1:seq.num_computed_tokens + 1] for seq in seqs]
        hidden = torch.cat([chunk for seq in seqs for chunk in seq.spec_hidden]) if seqs else None
        return DraftInputs(tokens, [seq.num_drafter_tokens for seq in seqs], hidden)

    def next_inputs(self, seqs, tokens: list[int], hidden: torch.Tensor, step: int) -> DraftInputs:
        return DraftInputs([[t] for t in tokens], [seq.num_computed_tokens - 1 + step for seq in seqs], hidden)

    def stash_hidden(self, seqs: list, num_new_tokens: list[int], hidden: torch.Tensor):
        """Each sequence's rows of the step's hidden states (the runner's tensor, kept: a view a sequence, no
        copy), until a proposal reads them; none for sequences that never draft. Past max_stashed_steps
        chunks, a sequence keeps its last KEPT_ROWS rows."""
        bound = self.max_stashed_steps()
        for seq, rows in zip(seqs, hidden.split(num_new_tokens)):
            if can_speculate(seq):
                seq.spec_hidden.append(rows)
                if bound is not None and len(seq.spec_hidden) > bound:
                    skip_behind(seq, KEPT_ROWS)

    def max_stashed_steps(self) -> int | None:
        """None: every row stays until a proposal reads it (the MTP layer attends from position 0)."""
        return None

    def advance(self, seq, step: int):
        if step == 0:
            seq.num_drafter_tokens, seq.spec_hidden = seq.num_computed_tokens, []

    def forward(self, input_ids, positions, meta, hidden: torch.Tensor | None) -> torch.Tensor:
        return self.model(input_ids, hidden, positions, meta)
