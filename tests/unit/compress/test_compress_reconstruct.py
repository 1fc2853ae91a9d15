"""Layer-wise least-squares reconstruction after structured pruning, on tiny random Llama models:
the refit lowers each layer's output error against plain slicing (on the calibration text and on
other text), is exact when the removed channels are linear in the kept ones, refits ``o_proj`` when
heads go, and the prune pipeline records it."""

from __future__ import annotations

import copy

import pytest
import torch

from gpufleet.compress import importance, prune
from gpufleet.compress import reconstruct as rc
from unit.compress.tinyllama import tiny_texts


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is fastest, and two spin against each other on a loaded 2-core host
    (0.5 s against 20+ s per test, measured next to a one-thread healing run)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def long_ids(tiny_tokenizer):
    """48 sequences of 64 tokens: 40 to calibrate on (20 per unknown of a 64-channel refit), 8 held out."""
    toks = tiny_tokenizer("\n".join(tiny_texts()), add_special_tokens=False)["input_ids"][: 48 * 64]
    return torch.tensor(toks).view(48, 64)


def _mlp_out_err(pruned, dense, ids, layer: int) -> float:
    """Relative error of the pruned layer's MLP output against the dense MLP, on the dense layer's
    MLP inputs for ``ids``."""
    got = {}
    d_mlp, p_mlp = dense.model.layers[layer].mlp, pruned.model.layers[layer].mlp
    h = d_mlp.register_forward_pre_hook(lambda m, a: got.setdefault("x", a[0].detach()))
    try:
        with torch.no_grad():
            dense(input_ids=ids, use_cache=False)
    finally:
        h.remove()
    with torch.no_grad():
        want, have = d_mlp(got["x"]), p_mlp(got["x"])
    return float((have - want).norm() / want.norm())


def _logit_err(pruned, dense, ids) -> float:
    with torch.no_grad():
        a = dense(input_ids=ids, use_cache=False).logits
        b = pruned(input_ids=ids, use_cache=False).logits
    return float((a - b).norm() / a.norm())


@pytest.mark.parametrize("mode", rc.MODES)
def test_reconstruction_lowers_the_error_of_plain_slicing(tiny, long_ids, mode):
    dense = copy.deepcopy(tiny)
    calib, other = long_ids[:40], long_ids[40:]
    imp = importance.measure(tiny, calib, bf16=False)
    chans = prune.shrink_mlp(tiny, imp.channel_rms, 64)  # half the channels
    sliced = copy.deepcopy(tiny)
    stats = rc.reconstruct(
        tiny, dense, calib, rc.Kept(layers=[0, 1, 2, 3], channels=chans), mode=mode, ridge=1e-3, bf16=False
    )
    assert stats["tokens"] == calib.numel() and len(stats["layers"]) == 4
    for rec in stats["layers"]:  # on the calibration activations, by construction of least squares
        assert rec["down_proj"]["rel_err_after"] < rec["down_proj"]["rel_err_before"]
    # measured directly on the dense inputs of the calibration text: every layer in dense mode (its
    # objective), the first layer in both (sequential mode fits later layers to the pruned inputs)
    for layer in range(4) if mode == "dense" else (0,):
        assert _mlp_out_err(tiny, dense, calib, layer) < _mlp_out_err(sliced, dense, calib, layer)
    for x in (calib, other):  # and what the model computes in the end, also on held-out text
        assert _logit_err(tiny, dense, x) < _logit_err(sliced, dense, x)
    assert tiny.model.layers[0].mlp.down_proj.weight.shape == (96, 64)  # widths unchanged


def test_reconstruction_is_exact_when_removed_channels_are_linear_in_kept_ones(tiny, ids):
    with torch.no_grad():  # channel 2k+1 = 0.5 x channel 2k (same gate row, half the up row)
        for layer in tiny.model.layers:
            mlp = layer.mlp
            mlp.gate_proj.weight[1::2] = mlp.gate_proj.weight[0::2]
            mlp.up_proj.weight[1::2] = 0.5 * mlp.up_proj.weight[0::2]
    dense = copy.deepcopy(tiny)
    keep = torch.arange(0, 128, 2)
    scores = torch.zeros(4, 128)
    scores[:, keep] = 1.0
    chans = prune.shrink_mlp(tiny, scores, 64)
    assert all(torch.equal(c, keep) for c in chans)
    sliced = copy.deepcopy(tiny)
    rc.reconstruct(
        tiny, dense, ids[:6], rc.Kept(layers=list(range(4)), channels=chans), ridge=0.0, bf16=False
    )
    # W' = W_even + 0.5 W_odd exactly; the whole model then computes the dense logits on any text
    w = dense.model.layers[2].mlp.down_proj.weight
    assert torch.allclose(tiny.model.layers[2].mlp.down_proj.weight, w[:, 0::2] + 0.5 * w[:, 1::2], atol=1e-4)
    assert _logit_err(tiny, dense, ids[6:]) < 1e-4
    assert _logit_err(sliced, dense, ids[6:]) > 1e-2


def test_o_proj_refit_after_head_pruning(tiny, ids):
    dense = copy.deepcopy(tiny)
    imp = importance.measure(tiny, ids, bf16=False)
    rows = prune.prune_heads(tiny, imp.heads, 2)  # 2 of 3 query heads per KV group
    assert all(len(r) == 4 * 16 for r in rows)
    sliced = copy.deepcopy(tiny)
    stats = rc.reconstruct(tiny, dense, ids[:6], rc.Kept(layers=list(range(4)), o_rows=rows), bf16=False)
    assert all(r["o_proj"]["rel_err_after"] < r["o_proj"]["rel_err_before"] for r in stats["layers"])
    assert "down_proj" not in stats["layers"][0]
    assert _logit_err(tiny, dense, ids[6:]) < _logit_err(sliced, dense, ids[6:])


def test_dropped_layers_are_skipped_and_mapped(tiny, ids):
    dense = copy.deepcopy(tiny)
    imp = importance.measure(tiny, ids, bf16=False)
    prune.drop_layers(tiny, [1])
    chans = prune.shrink_mlp(tiny, imp.channel_rms[[0, 2, 3]], 64)
    for mode in rc.MODES:
        stats = rc.reconstruct(
            tiny, dense, ids[:4], rc.Kept(layers=[0, 2, 3], channels=chans), mode=mode, bf16=False
        )
        assert [r["source"] for r in stats["layers"]] == [0, 2, 3]
    with pytest.raises(ValueError):
        rc.reconstruct(tiny, dense, ids[:4], rc.Kept(layers=[0, 1], channels=chans))
