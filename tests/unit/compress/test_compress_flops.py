"""The compute side of pruning: the layer-FLOPs count equals what torch's FLOP counter measures, the
``--min-layer-flops-cut`` constraint holds for depth, width and the ``auto`` search (which also tries
one query head fewer per KV group), the ``out`` channel score ranks by what a channel writes to the
residual stream, and the healing token pool grows with long runs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gpufleet.compress import heal, importance, pipeline, prune
from gpufleet.compress.config import ChannelScore, HealConfig, Method, PruneConfig
from gpufleet.compress.export import save_hf
from gpufleet.core.errors import UsageError
from unit.compress.tinyllama import tiny_texts


def _counted_flops(model, n: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model.config._attn_implementation = "eager"  # matmuls the counter sees (sdpa on CPU it does not)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model.model(input_ids=ids)  # decoder only: no LM head
    return counter.get_total_flops()


@pytest.mark.parametrize("cut", ["dense", "mlp", "heads"])
def test_layer_flops_equals_the_flop_counter(tiny, ids, cut):
    if cut == "mlp":
        prune.shrink_mlp(tiny, importance.measure(tiny, ids).channels, 64)
    elif cut == "heads":
        prune.prune_heads(tiny, importance.measure(tiny, ids).heads, 2)
    cfg, n = tiny.config, 48
    hd, n_q = cfg.head_dim, cfg.num_attention_heads
    # the dense kernel also computes the masked half of the scores; layer_flops counts the causal half
    masked = 4 * n_q * hd * (n * n - n * (n + 1) / 2)
    expect = cfg.num_hidden_layers * (n * pipeline.layer_flops(cfg, context=n) + masked)
    assert _counted_flops(tiny, n) == pytest.approx(expect, rel=1e-9)


@pytest.fixture
def on_disk(tiny, tiny_tokenizer, tmp_path) -> dict[str, Path]:
    save_hf(tiny, tiny_tokenizer, tmp_path / "dense")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(16):
        (corpus / f"f{i}.py").write_text(tiny_texts()[i % 2])
    return {"dense": tmp_path / "dense", "corpus": corpus, "root": tmp_path}


def _prune(on_disk, name: str, **kw) -> dict:
    cfg = PruneConfig(
        model=str(on_disk["dense"]),
        out=on_disk["root"] / name,
        domain=str(on_disk["corpus"]),
        tokens=512,
        seq_len=64,
        **kw,
    )
    return pipeline.prune(cfg)


def test_depth_drops_more_layers_to_meet_the_flops_cut(on_disk):
    plain = _prune(on_disk, "d0", method=Method.DEPTH, target=0.95)
    cut = _prune(on_disk, "d1", method=Method.DEPTH, target=0.95, min_layer_flops_cut=0.45)
    assert len(plain["dropped_layers"]) == 1 and plain["layer_flops_ratio"] == 0.75
    assert len(cut["dropped_layers"]) == 2 and cut["layer_flops_ratio"] <= 0.55
    assert cut["min_layer_flops_cut"] == 0.45 and cut["params"] < plain["params"]


def test_auto_search_meets_the_cut_and_tries_fewer_heads(on_disk):
    rec = _prune(on_disk, "a", method=Method.AUTO, target=0.95, min_layer_flops_cut=0.2)
    assert rec["layer_flops_ratio"] <= 0.8 and rec["params"] <= 0.95 * rec["dense_params"]
    heads = {c["heads_per_group"] for c in rec["candidates"]}
    assert heads == {3, 2}  # 6 query heads in 2 KV groups: 3 per group, or one fewer
    best = min(rec["candidates"], key=lambda c: c["calib_loss"])
    assert (rec["mlp_width"], rec["heads_per_group"]) == (best["mlp_width"], best["heads_per_group"])
    assert rec["config"]["num_attention_heads"] == 2 * rec["heads_per_group"]
    for c in rec["candidates"]:  # every candidate the search scored met both constraints
        assert c["candidate_params"] <= 0.95 * rec["dense_params"]
    from transformers import AutoConfig

    back, dense_cfg = (
        AutoConfig.from_pretrained(on_disk["root"] / "a"),
        AutoConfig.from_pretrained(on_disk["dense"]),
    )
    layers = back.num_hidden_layers * pipeline.layer_flops(back)
    dense = dense_cfg.num_hidden_layers * pipeline.layer_flops(dense_cfg)
    assert layers / dense == pytest.approx(rec["layer_flops_ratio"], abs=1e-4)


def test_out_score_drops_an_active_channel_that_writes_nothing(tiny, ids):
    imp = importance.measure(tiny, ids)
    loud = int(imp.channels[0].argmax())
    with torch.no_grad():
        tiny.model.layers[0].mlp.down_proj.weight[:, loud] = 0.0  # active, but adds nothing to the residual
    imp = importance.measure(tiny, ids)
    out = importance.channel_scores(imp, tiny, "out")
    cols = tiny.model.layers[1].mlp.down_proj.weight.detach().norm(dim=0)
    assert torch.allclose(out[1], imp.channel_rms[1] * cols)
    assert out[0, loud] == 0.0 and imp.channels[0, loud] > 0.0
    assert importance.channel_scores(imp, tiny, "act") is imp.channels
    gate = tiny.model.layers[0].mlp.gate_proj.weight.detach().clone()
    by_act = copy.deepcopy(tiny)
    prune.shrink_mlp(tiny, out, 64)
    prune.shrink_mlp(by_act, imp.channels, 64)
    kept = tiny.model.layers[0].mlp.gate_proj.weight
    assert not (kept == gate[loud]).all(dim=1).any()  # "out" dropped the silent channel
    assert (by_act.model.layers[0].mlp.gate_proj.weight == gate[loud]).all(dim=1).any()  # "act" kept it


def test_flops_options_are_validated():
    with pytest.raises(UsageError, match="min-layer-flops-cut must be in"):
        PruneConfig(out=Path("x"), min_layer_flops_cut=1.0)
    with pytest.raises(UsageError, match="needs a structured method"):
        PruneConfig(out=Path("x"), method=Method.WANDA, min_layer_flops_cut=0.2)
    with pytest.raises(UsageError, match="--flops-context"):
        PruneConfig(out=Path("x"), flops_context=0)
    assert PruneConfig(out=Path("x")).channel_score == ChannelScore.OUT


def test_heal_pool_grows_with_long_runs():
    short = HealConfig(student=Path("s"), out=Path("o"), steps=20, batch=2, seq_len=128)
    long = HealConfig(student=Path("s"), out=Path("o"), steps=300, batch=4, seq_len=256)
    assert heal.pool_tokens(short) == 2 * 20 * 2 * 128  # short runs: as before (twice their tokens)
    assert heal.pool_tokens(long) == 300 * 4 * 256  # long runs: a fresh batch's worth per step


def test_heal_batches_read_every_pool_row_once_per_pass():
    chunks, batch = 10, 4  # passes do not split evenly: a batch may straddle two passes
    steps = 15  # six passes' worth of rows
    drawn = [heal.batch_rows(3, s, chunks, batch) for s in range(steps)]
    flat = [r for rows in drawn for r in rows]
    passes = [flat[i : i + chunks] for i in range(0, len(flat), chunks)]
    for p in passes:
        assert sorted(p) == list(range(chunks))  # each row once per pass, none left unread
    assert len({tuple(p) for p in passes}) > 1  # each pass its own order
    # a pure function of (seed, step): a resumed run or a replay draws the same batch
    assert [heal.batch_rows(3, s, chunks, batch) for s in (7, 2, 14)] == [drawn[7], drawn[2], drawn[14]]
    assert (
        heal.batch_rows(4, 0, chunks, batch) != drawn[0] or heal.batch_rows(4, 1, chunks, batch) != drawn[1]
    )
    with pytest.raises(ValueError, match="cannot give batches"):
        heal.batch_rows(0, 0, 0, 4)
