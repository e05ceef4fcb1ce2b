"""DeepSeek-V3 MTP as the proposer (spec_decode/mtp.py), float32. With a random MTP layer, every first
draft is the one a reference built from HF's own modules predicts (HF's target hidden states, the MTP block
as an HF DeepseekV3 decoder layer over all entries): the MTP's KV and the hidden states handed to it are right
through chunked prefill, preemption (both modes) and prefix-cache hits. With an MTP layer that echoes the
target's last prediction, on a target that often repeats itself, drafts are accepted and rejected and the
greedy output is HF's under every scenario, with stop tokens, max_tokens, n > 1 and logprobs."""
import copy
import os
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import assert_all_blocks_free, hf_greedy, make_prompts
from pagedmoe import LLM, SamplingParams
from test_draft_model import record_proposals
from test_spec_decode_engine import greedy_tokens

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from test_deepseek import add_mtp_layer, deepseek_configs, save_deepseek  # noqa: E402

K, NUM_NEW = 2, 24
MTP_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


def edit_weights(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    cfg = deepseek_configs()["v3"]
    path = str(tmp_path_factory.mktemp("mtp-random"))
    model = save_deepseek(cfg, path, seed=0)
    add_mtp_layer(path, cfg)
    return path, cfg, model


@pytest.fixture(scope="module")
def echo_mtp(tmp_path_factory):
    """A tied-embedding target whose attention and MLP outputs are scaled down (it often repeats its last
    token), and an MTP layer whose block adds nothing and whose projection passes the hidden state through:
    it predicts what the target predicted one position earlier, i.e. a repeat."""
    cfg = deepseek_configs()["v3_default_rope_tied"]
    path = str(tmp_path_factory.mktemp("mtp-echo"))
    save_deepseek(cfg, path, seed=0)
    scale = lambda t: {n: v * 0.1 for n, v in t.items() if n.endswith("o_proj.weight") or "down_proj" in n}
    edit_weights(path, lambda t: t.update(scale(t)))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    add_mtp_layer(path, cfg)
    prefix, hidden = f"model.layers.{cfg.num_hidden_layers}.", cfg.hidden_size

    def echo(t):
        t[prefix + "eh_proj.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)
        t[prefix + "shared_head.head.weight"] = t["model.embed_tokens.weight"].clone()
        t.update({n: v * 0 for n, v in t.items() if n.startswith(prefix) and (n.endswith("o_proj.weight")
                                                                              or "down_proj" in n)})
    edit_weights(path, echo)
    return path, model


def mtp_llm(path: str, **engine_args) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}
    return LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=spec, **engine_args)


class ReferenceMTP:
    """The MTP layer from HF's modules: the block as a one-layer HF DeepseekV3 checkpoint (loaded by HF) whose
    final norm is shared_head.norm, fed eh_proj([enorm(embed(t_j+1)); hnorm(h_j)]) with h the HF target's
    final hidden states."""

    def __init__(self, path: str, cfg, target, scratch):
        tensors, layer = load_file(os.path.join(path, "model.safetensors")), cfg.num_hidden_layers
        prefix = f"model.layers.{layer}."
        weights = {n.replace(prefix, "model.layers.0."): t for n, t in tensors.items()
                   if n.startswith(prefix) and not n.removeprefix(prefix).startswith(MTP_NAMES)}
        weights |= {"model.norm.weight": tensors[prefix + "shared_head.norm.weight"],
                    "model.embed_tokens.weight": tensors[prefix + "embed_tokens.weight"],
                    "lm_head.weight": tensors[prefix + "shared_head.head.weight"]}
        one = copy.deepcopy(cfg)
        one.num_hidden_layers, one.first_k_dense_replace = 1, 0
        one.save_pretrained(scratch)
        save_file(weights, os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})
        self.block = transformers.AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32).model.eval()
        self.w = {n: tensors[prefix + n + ".weight"] for n in ("enorm", "hnorm", "eh_proj", "shared_head.head")}
        self.target, self.eps = target, cfg.rms_norm_eps

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    @torch.no_grad()
    def first_draft(self, token_ids: list[int]) -> int:
        tokens = torch.tensor([token_ids])
        hidden = self.target.model(tokens).last_hidden_state[0, :-1]
        embeds = self.block.embed_tokens(tokens[0, 1:])
        embeds[0] = 0  # entry 0 sits at position 0 (as vLLM)
        x = torch.cat([self.rms(embeds, self.w["enorm"]), self.rms(hidden, self.w["hnorm"])], -1) @ self.w["eh_proj"].T
        out = self.block(inputs_embeds=x[None], position_ids=torch.arange(len(x))[None]).last_hidden_state[0, -1]
        return int((out @ self.w["shared_head.head"].T).argmax())


SCENARIOS = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "recompute": dict(num_kv_blocks=10, preemption_mode="recompute"),
    "swap": dict(num_kv_blocks=10, preemption_mode="swap"),
}


@pytest.mark.parametrize("scenario", [*SCENARIOS, "prefix_hits"])
def test_first_drafts_match_the_reference(random_mtp, scenario, tmp_path):
    path, cfg, target = random_mtp
    prompts = make_prompts(5, seed=2, min_len=34, max_len=60)
    llm = mtp_llm(path, **SCENARIOS.get(scenario, {}))
    if scenario == "prefix_hits":
        greedy_tokens(llm, prompts, NUM_NEW)
    calls = record_proposals(llm)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    reference = ReferenceMTP(path, cfg, target, tmp_path)
    assert calls and all(drafts[0] == reference.first_draft(tokens) for tokens, drafts in calls[::3] if drafts)
    if scenario == "prefix_hits":
        assert llm.engine.get_stats().prefix_cache_hits > 0
    if scenario in ("recompute", "swap"):
        assert getattr(llm.engine.get_stats(), f"num_preemptions_{scenario}") > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_identical_with_accepted_drafts(echo_mtp, scenario):
    path, target = echo_mtp
    prompts = make_prompts(6, seed=1)
    llm = mtp_llm(path, **SCENARIOS[scenario])
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    stats = llm.engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_blocks_free(llm.engine)


def test_stops_lengths_samples_and_logprobs(echo_mtp):
    path, target = echo_mtp
    prompts = make_prompts(4, seed=3)
    expected = [hf_greedy(target, p, NUM_NEW) for p in prompts]
    llm, plain = mtp_llm(path), LLM(path, dtype="float32", skip_tokenizer_init=True)
    for max_tokens in (1, 2, 5):
        assert greedy_tokens(llm, prompts, max_tokens) == [e[:max_tokens] for e in expected]
    for prompt, ref in zip(prompts, expected):
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, stop_token_ids=[ref[6]])
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:ref.index(ref[6]) + 1] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, n=2, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for ref, got in zip(plain.generate(inputs, params, use_tqdm=False), llm.generate(inputs, params, use_tqdm=False)):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in ref.outputs]
        assert abs(ref.outputs[0].cumulative_logprob - got.outputs[0].cumulative_logprob) < 1e-3
    assert llm.engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_a_checkpoint_without_an_mtp_layer_is_a_value_error(tmp_path):
    save_deepseek(deepseek_configs()["v3"], tmp_path, seed=0)
    with pytest.raises(ValueError, match="mtp"):
        mtp_llm(str(tmp_path))
