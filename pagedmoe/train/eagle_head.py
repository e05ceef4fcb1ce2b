"""The EAGLE-3 head in plain torch for training, with training-time test (EAGLE-3's multi-step unrolled
loss): step 0 feeds the target's fused hidden states, step s > 0 feeds at entry j the head's own output of
step s - 1 at entry j - 1, and attends to the step-0 keys up to entry j - s and to the keys of steps 1..s
along its own draft path (entries j - s + 1 .. j), exactly what decoding k drafts from one context sees.
Parameter names are EAGLE-3's checkpoint names; pagedmoe/spec_decode/eagle.py runs the exported head."""
import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class MidLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm, self.hidden_norm = Norm(hidden, eps), Norm(hidden, eps)
        self.post_attention_layernorm = Norm(hidden, eps)
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(2 * hidden, heads * head_dim, bias=False),
                                        "k_proj": nn.Linear(2 * hidden, kv_heads * head_dim, bias=False),
                                        "v_proj": nn.Linear(2 * hidden, kv_heads * head_dim, bias=False),
                                        "o_proj": nn.Linear(heads * head_dim, hidden, bias=False)})
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(hidden, inter, bias=False),
                                  "up_proj": nn.Linear(hidden, inter, bias=False),
                                  "down_proj": nn.Linear(inter, hidden, bias=False)})

    def qkv(self, embeds, hidden, cos, sin):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        shape = lambda t, n: t.view(*t.shape[:2], n, self.head_dim).transpose(1, 2)  # [B, n, N, d]
        q = rotate(shape(self.self_attn["q_proj"](x), self.heads), cos, sin)
        k = rotate(shape(self.self_attn["k_proj"](x), self.kv_heads), cos, sin)
        return q, k, shape(self.self_attn["v_proj"](x), self.kv_heads)

    def finish(self, hidden, attn):
        x = hidden + self.self_attn["o_proj"](attn.transpose(1, 2).flatten(2))
        gated = F.silu(self.mlp["gate_proj"](self.post_attention_layernorm(x)))
        return x + self.mlp["down_proj"](gated * self.mlp["up_proj"](self.post_attention_layernorm(x)))


class Eagle3TrainHead(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, num_aux: int,
                 eps: float, rope_theta: float):
        super().__init__()
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.midlayer = MidLayer(hidden, heads, kv_heads, head_dim, inter, eps)
        self.norm = Norm(hidden, eps)
        self.head_dim, self.rope_theta = head_dim, rope_theta

    def rope(self, num: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        freqs = torch.arange(num, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        return emb.cos(), emb.sin()

    def unroll(self, embeds: torch.Tensor, aux: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """Pre-norm outputs of each step, [B, N, hidden]: at every step entry j predicts token j + 2."""
        cos, sin = self.rope(embeds.shape[1], embeds.device)
        hidden, keys, values, outputs = self.fc(aux), [], [], []
        for step in range(num_steps):
            q, k, v = self.midlayer.qkv(embeds, hidden, cos, sin)
            keys.append(k)
            values.append(v)
            outputs.append(self.midlayer.finish(hidden, self.attend(q, keys, values)))
            hidden = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))  # entry j takes entry j - 1's output
        return outputs

    def attend(self, q, keys, values) -> torch.Tensor:
        """Step s = len(keys) - 1: step-0 keys up to entry j - s, then one key per later step on the path."""
        step, group = len(keys) - 1, q.shape[1] // keys[0].shape[1]
        keys = [k.repeat_interleave(group, dim=1) for k in keys]
        values = [v.repeat_interleave(group, dim=1) for v in values]
        num = q.shape[2]
        scores = [q @ keys[0].transpose(-1, -2) * self.head_dim ** -0.5]
        allowed = torch.arange(num)[None, :] <= torch.arange(num)[:, None] - step
        scores[0] = scores[0].masked_fill(~allowed.to(q.device), float("-inf"))
        path = [shift(keys[r], step - r) for r in range(1, step + 1)]
        scores += [(q * k).sum(-1, keepdim=True) * self.head_dim ** -0.5 for k in path]
        probs = torch.cat(scores, dim=-1).softmax(dim=-1)
        out = probs[..., :num] @ values[0]
        for r in range(1, step + 1):
            out = out + probs[..., num + r - 1:num + r] * shift(values[r], step - r)
        return out


def shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[..., j - by, :] at entry j (zeros before the start)."""
    return x if by == 0 else F.pad(x[..., :-by, :], (0, 0, by, 0))


def ttt_loss(head: Eagle3TrainHead, embed: nn.Module, lm_head: nn.Module, tokens, aux, target_logits,
             num_steps: int, decay: float = 0.8) -> tuple[torch.Tensor, list[float]]:
    """Forward KL to the target's next-token distribution at every step, weighted decay ** s. tokens [B, T];
    aux [B, T, 3h] and target_logits [B, T, V] from the target over the same tokens."""
    embeds, fused = embed(tokens[:, 1:]), aux[:, :-1]
    outputs = head.unroll(embeds, fused, num_steps)
    total, accuracies = 0.0, []
    for step, out in enumerate(outputs):
        num = tokens.shape[1] - 2 - step  # entries j >= step whose token j + 2 + step exists
        logits = lm_head(head.norm(out[:, step:step + num]))
        target = target_logits[:, 1 + step:1 + step + num].float().softmax(-1)  # the target at position j + 1 + s
        total = total + decay ** step * -(target * logits.log_softmax(-1)).sum(-1).mean()
        accuracies.append(float((logits.argmax(-1) == target.argmax(-1)).float().mean()))
    return total, accuracies
