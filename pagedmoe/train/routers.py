"""Trainable routers that are drop-in subclasses of the HF routers they export to.

Each router subclasses the transformers router class of the export architecture, keeps its
parameter names (`weight`, `e_score_correction_bias`) and, in eval mode, runs the parent's
forward unchanged: inference routing is HF's routing by construction. Training-only behaviour
(noise, capacity drops, auxiliary losses, bias updates) lives in the training branch. Every
router records the last step's per-expert load, dropped assignments and (unscaled) aux loss on
itself, so the trainer reads them from the modules instead of from hidden global state.

Capacity drops are expressed as a zero combine weight: the HF experts module still computes the
dropped (token, expert) pair, but its contribution and gradient vanish, so the token's residual
passes through the layer unchanged, as in Switch/GShard.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter


def cv_squared(values: torch.Tensor) -> torch.Tensor:
    return values.float().var(unbiased=False) / (values.float().mean() ** 2 + 1e-10)


def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    return math.ceil(math.ceil(top_k * tokens / num_experts) * factor)


def capacity_keep_mask(indices: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """First choices of all tokens claim slots before second choices (GShard); within a choice, token order."""
    slot_major = indices.t().reshape(-1)
    one_hot = F.one_hot(slot_major, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1)
    return (position <= capacity).view(indices.t().shape).t()


def switch_balance_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """N * sum_i f_i * P_i with f_i the (detached) fraction of assignments and P_i the mean router prob."""
    fraction = torch.bincount(indices.flatten(), minlength=num_experts).float() / indices.numel()
    return num_experts * (fraction.detach() * probs.mean(0)).sum()


class LoadRecorder:
    def reset_records(self, num_experts: int) -> None:
        self.last_load = torch.zeros(num_experts)
        self.last_dropped = 0
        self.last_assignments = 0
        self.last_aux_loss = torch.zeros(())

    def record(self, indices: torch.Tensor, dropped: int = 0, aux_loss: torch.Tensor | None = None) -> None:
        self.last_load = torch.bincount(indices.detach().flatten(), minlength=self.num_experts).float()
        self.last_dropped = int(dropped)
        self.last_assignments = indices.numel()
        self.last_aux_loss = torch.zeros(()) if aux_loss is None else aux_loss

    def after_step(self) -> None:
        pass


class SoftmaxTopKRouter(Qwen3MoeTopKRouter, LoadRecorder):
    """Softmax top-k without any balancing (the control); identical to HF in train and eval."""

    def __init__(self, config):
        super().__init__(config)
        self.reset_records(self.num_experts)

    def forward(self, hidden_states):
        logits, weights, indices = super().forward(hidden_states)
        self.record(indices)
        return logits, weights, indices


class CapacityRouter(SoftmaxTopKRouter):
    """Switch (top-1, un-normalised gate) and GShard (top-2, normalised) with expert capacity and aux loss."""

    def __init__(self, config, capacity_factor: float = 1.25):
        super().__init__(config)
        self.capacity_factor = capacity_factor

    def forward(self, hidden_states):
        if not self.training:
            return super().forward(hidden_states)
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top_values, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        capacity = expert_capacity(len(hidden_states), self.num_experts, self.top_k, self.capacity_factor)
        keep = capacity_keep_mask(indices, self.num_experts, capacity)
        self.record(indices, (~keep).sum(), switch_balance_loss(probs, indices, self.num_experts))
        return logits, (top_values * keep).to(logits.dtype), indices


class NoisyTopKRouter(SoftmaxTopKRouter):
    """Shazeer et al. 2017: KeepTopK(x W_g + eps * softplus(x W_noise)) then softmax; importance + load losses."""

    def __init__(self, config):
        super().__init__(config)
        self.noise_weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states):
        if not self.training:
            return super().forward(hidden_states)
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        clean = F.linear(hidden_states, self.weight).float()
        noise_std = F.softplus(F.linear(hidden_states, self.noise_weight).float())
        noisy = clean + torch.randn_like(clean) * noise_std
        top_values, indices = torch.topk(noisy, self.top_k + 1, dim=-1)
        gates = F.softmax(top_values[:, : self.top_k], dim=-1)
        indices = indices[:, : self.top_k]
        aux = self.balance_loss(clean, noisy, noise_std, top_values, indices, gates)
        self.record(indices, aux_loss=aux)
        return clean.to(hidden_states.dtype), gates.to(hidden_states.dtype), indices

    def balance_loss(self, clean, noisy, noise_std, top_values, indices, gates) -> torch.Tensor:
        importance = torch.zeros_like(clean).scatter(1, indices, gates).sum(0)
        threshold_if_in = top_values[:, self.top_k :]
        threshold_if_out = top_values[:, self.top_k - 1 : self.top_k]
        threshold = torch.where(noisy > threshold_if_in, threshold_if_in, threshold_if_out)
        normal = torch.distributions.Normal(0.0, 1.0)
        load = normal.cdf((clean - threshold) / noise_std).sum(0)
        return cv_squared(importance) + cv_squared(load)


class SigmoidBiasRouter(DeepseekV3TopkRouter, LoadRecorder):
    """DeepSeek-V3: sigmoid affinities, top-k on affinity + bias, bias nudged by gamma after each step."""

    def __init__(self, config, bias_update_speed: float = 1e-3):
        super().__init__(config)
        self.bias_update_speed = bias_update_speed
        self.reset_records(self.num_experts)

    def forward(self, hidden_states):
        logits, weights, indices = super().forward(hidden_states)
        aux = self.sequence_balance_loss(logits, indices, hidden_states.shape[:-1]) if self.training else None
        self.record(indices, aux_loss=aux)
        return logits, weights, indices

    def sequence_balance_loss(self, logits, indices, batch_shape) -> torch.Tensor:
        sequences, length = (1, batch_shape[0]) if len(batch_shape) == 1 else batch_shape
        scores = logits.sigmoid().view(sequences, length, self.num_experts)
        mean_affinity = (scores / scores.sum(-1, keepdim=True)).mean(1)
        one_hot = F.one_hot(indices.view(sequences, -1), self.num_experts).sum(1).float()
        fraction = one_hot * self.num_experts / (self.top_k * length)
        return (fraction.detach() * mean_affinity).sum(-1).mean()

    @torch.no_grad()
    def after_step(self) -> None:
        overload = torch.sign(self.last_load - self.last_load.mean())
        self.e_score_correction_bias -= self.bias_update_speed * overload.to(self.e_score_correction_bias.device)
