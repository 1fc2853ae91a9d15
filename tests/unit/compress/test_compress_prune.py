"""Structured pruning on tiny random Llama models: every cut model still runs, has the widths and
counts its config claims, keeps the chosen (most important) structures, and reloads with stock
transformers to identical logits."""

from __future__ import annotations

import pytest
import torch

from gpufleet.compress import importance, prune
from gpufleet.compress.export import max_logit_diff, save_hf
from gpufleet.compress.model import param_count
from gpufleet.compress.pipeline import estimate_params
from gpufleet.core.errors import UsageError


def test_importance_shapes_and_gqa_groups(tiny, ids):
    imp = importance.measure(tiny, ids, corpus="t", wanda=True)
    assert imp.tokens == ids.numel()
    assert len(imp.layers) == 4 and all(0.0 <= b <= 2.0 for b in imp.layers)
    assert len(imp.heads) == 4 and all(len(r) == 6 for r in imp.heads)
    for row, groups in zip(imp.heads, imp.groups, strict=True):  # query heads 0-2 share KV head 0, 3-5 head 1
        assert groups == pytest.approx([sum(row[0:3]), sum(row[3:6])])
    assert tuple(imp.channels.shape) == (4, 128) and bool((imp.channels >= 0).all())
    assert len(imp.input_norms) == 4 * 7
    assert set(imp.summary()) >= {"block_influence", "heads", "kv_groups", "channels_mean"}


def test_block_influence_of_an_identity_layer_is_zero(tiny, ids):
    layer = tiny.model.layers[2]
    with torch.no_grad():  # zero output projections: the layer adds nothing to the residual stream
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    imp = importance.measure(tiny, ids)
    assert imp.layers[2] == pytest.approx(0.0, abs=1e-6)
    assert prune.lowest(imp.layers, 1) == [2]


def test_drop_layers_equals_skipping_them(tiny, ids):
    x = ids[:2]
    dense_layers = list(tiny.model.layers)
    prune.drop_layers(tiny, [1, 2])
    assert tiny.config.num_hidden_layers == 2 and len(tiny.model.layers) == 2
    assert [ly.self_attn.layer_idx for ly in tiny.model.layers] == [0, 1]
    assert tiny.model.layers[1] is dense_layers[3]
    out = tiny(input_ids=x).logits
    assert out.shape == (2, 64, tiny.config.vocab_size)
    with pytest.raises(UsageError):
        prune.drop_layers(tiny, [0, 1])


def test_shrink_mlp_keeps_the_most_active_channels(tiny, ids):
    imp = importance.measure(tiny, ids)
    top = torch.topk(imp.channels[0], 32).indices.sort().values
    gate0 = tiny.model.layers[0].mlp.gate_proj.weight.detach().clone()
    prune.shrink_mlp(tiny, imp.channels, 32)
    mlp = tiny.model.layers[0].mlp
    assert mlp.gate_proj.weight.shape == (32, 96) and mlp.down_proj.weight.shape == (96, 32)
    assert torch.equal(mlp.gate_proj.weight, gate0[top])
    assert tiny.config.intermediate_size == 32
    assert param_count(tiny) == estimate_params(tiny.config)
    tiny(input_ids=ids[:1])


def test_mlp_pruning_by_activation_beats_the_reverse_order(tiny, ids):
    """The kept channels matter: keeping the most active loses less than keeping the least active."""
    import copy

    imp = importance.measure(tiny, ids)
    best, worst = copy.deepcopy(tiny), copy.deepcopy(tiny)
    prune.shrink_mlp(best, imp.channels, 64)
    prune.shrink_mlp(worst, -imp.channels, 64)
    with torch.no_grad():
        ref = tiny(input_ids=ids).logits
        err_best = (best(input_ids=ids).logits - ref).pow(2).mean()
        err_worst = (worst(input_ids=ids).logits - ref).pow(2).mean()
    assert err_best < err_worst


def test_prune_heads_keeps_whole_gqa_groups(tiny, ids):
    imp = importance.measure(tiny, ids)
    q0 = tiny.model.layers[0].self_attn.q_proj.weight.detach().clone()
    prune.prune_heads(tiny, imp.heads, 2)
    cfg = tiny.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    att = tiny.model.layers[0].self_attn
    assert att.q_proj.weight.shape == (64, 96) and att.k_proj.weight.shape == (32, 96)
    assert att.o_proj.weight.shape == (96, 64) and att.num_key_value_groups == 2
    # in each KV group the two most active query heads survive, in order
    row = imp.heads[0]
    kept = [h for g in (range(0, 3), range(3, 6)) for h in sorted(sorted(g, key=lambda h: -row[h])[:2])]
    expect = torch.cat([q0[h * 16 : (h + 1) * 16] for h in kept])
    assert torch.equal(att.q_proj.weight, expect)
    assert param_count(tiny) == estimate_params(cfg)
    tiny(input_ids=ids[:1])


def test_drop_kv_groups_takes_its_query_heads_along(tiny, ids):
    imp = importance.measure(tiny, ids)
    prune.drop_kv_groups(tiny, imp.groups, 1)
    cfg = tiny.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (3, 1)
    assert tiny.model.layers[0].self_attn.k_proj.weight.shape == (16, 96)
    tiny(input_ids=ids[:1])


def test_heads_that_do_not_divide_the_hidden_size_are_refused(tiny_tokenizer):
    from unit.compress.tinyllama import make_tiny

    m = make_tiny(len(tiny_tokenizer), kv_heads=6)  # no GQA: every group is one head
    with pytest.raises(UsageError, match="do not divide the hidden size 96"):
        prune.drop_kv_groups(m, [[1.0] * 6] * 4, 5)


def test_wanda_zeroes_the_lowest_scores_per_row(tiny, ids):
    imp = importance.measure(tiny, ids, wanda=True)
    w = tiny.model.layers[0].mlp.up_proj.weight.detach().clone()
    zeroed = prune.wanda(tiny, imp.input_norms, 0.5)
    after = tiny.model.layers[0].mlp.up_proj.weight
    assert zeroed == sum(m.weight.numel() // 2 for n, m in tiny.named_modules() if n in imp.input_norms)
    assert int((after == 0).sum(dim=1).min()) == 48  # half of every row
    score = w.abs() * imp.input_norms["model.layers.0.mlp.up_proj"]
    for r in range(score.shape[0]):  # per output row: every zeroed score <= every kept one
        assert score[r][after[r] == 0].max() <= score[r][after[r] != 0].min()


def test_pruned_model_reloads_with_stock_transformers(tiny, tiny_tokenizer, ids, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    imp = importance.measure(tiny, ids)
    prune.drop_layers(tiny, prune.lowest(imp.layers, 1))
    prune.shrink_mlp(tiny, imp.channels[[0, 1, 2]], 64)  # the channels of the kept layers
    save_hf(tiny, tiny_tokenizer, tmp_path / "m", {"method": "test"})
    assert (tmp_path / "m" / "model.safetensors").is_file()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert back.config.num_hidden_layers == 3 and back.config.intermediate_size == 64
    assert max_logit_diff(tiny, back, ids[:1]) == 0.0
    assert len(AutoTokenizer.from_pretrained(tmp_path / "m")) == len(tiny_tokenizer)


def test_random_baseline_is_seeded():
    assert prune.random_layers(30, 8, seed=1) == prune.random_layers(30, 8, seed=1)
    assert all(0 < i < 29 for i in prune.random_layers(30, 8, seed=2))
