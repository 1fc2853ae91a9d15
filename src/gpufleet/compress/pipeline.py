"""The steps of ``gpufleet compress``, as library calls: analyze, prune, evaluate, export.

Each takes a typed config (:mod:`.config`) and returns a JSON-friendly dict; the CLI renders it.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufleet.compress import corpus, importance
from gpufleet.compress import export as ex
from gpufleet.compress import prune as pr
from gpufleet.compress import reconstruct as rc
from gpufleet.compress.config import AnalyzeConfig, EvalConfig, Method, PruneConfig
from gpufleet.compress.model import Loaded, load, param_count, use_bf16
from gpufleet.core.errors import UsageError
from gpufleet.core.paths import read_json

__all__ = ["analyze", "prune", "evaluate", "export", "estimate_params", "layer_flops", "Progress"]

Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    return None


def calib(
    loaded: Loaded, spec: str, n: int, seq_len: int, split: corpus.Split = "train", *, per_file: int = 0
) -> Any:
    return corpus.chunks(corpus.tokens(loaded.tokenizer, spec, split, n, per_file=per_file), seq_len)


def analyze(cfg: AnalyzeConfig, *, out: Path | None = None, progress: Progress = _quiet) -> dict[str, Any]:
    """Importance on the domain and the general corpus, side by side (and a plot under ``out``)."""
    progress("loading the model")
    loaded = load(cfg.model)
    bf16 = use_bf16(cfg.bf16)
    res: dict[str, Any] = {
        "model": loaded.source,
        "params": param_count(loaded.model),
        "precision": "bf16" if bf16 else "fp32",
    }
    imps = {}
    for role, spec in (("domain", cfg.domain), ("general", cfg.general)):
        progress(f"measuring importance on {role} text ({spec})")
        imps[role] = importance.measure(
            loaded.model,
            calib(loaded, spec, cfg.tokens, cfg.seq_len, per_file=cfg.calib_per_file),
            corpus=spec,
            bf16=bf16,
        )
        res[role] = imps[role].summary()
    d, g = imps["domain"].layers, imps["general"].layers
    res["layer_ranking_domain"] = sorted(range(len(d)), key=lambda i: d[i])
    res["domain_share"] = [round(a / (a + b), 4) if a + b else 0.5 for a, b in zip(d, g, strict=True)]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "analysis.json").write_text(json.dumps(res, indent=1) + "\n")
        import torch

        torch.save({r: i.channels for r, i in imps.items()}, out / "channels.pt")
        from gpufleet.compress.plots import plot_analysis

        res["plot"] = str(plot_analysis(imps["domain"], imps["general"], out / "analysis.png"))
    return res


def estimate_params(cfg: Any) -> int:
    """Parameters of a Llama config (tied embedding counted once)."""
    h, n_q, n_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // n_q
    per_layer = 2 * h + 2 * h * n_q * hd + 2 * h * n_kv * hd + 3 * h * cfg.intermediate_size
    emb = cfg.vocab_size * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return emb + h + cfg.num_hidden_layers * per_layer


def _layer_params(cfg: Any, inter: int | None = None) -> int:
    h, n_q, n_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // n_q
    width = cfg.intermediate_size if inter is None else inter
    return 2 * h + 2 * h * n_q * hd + 2 * h * n_kv * hd + 3 * h * width


def layer_flops(cfg: Any, *, context: int = 256, inter: int | None = None) -> float:
    """Forward FLOPs per token of one decoder layer in a prefill of ``context`` tokens: 2 per weight
    of the projections, plus the attention scores and the weighted sum of values, 2 x 2 x query heads
    x head dim x the mean context ((context + 1) / 2). Norms, rotary and activations are left out."""
    h, n_q, n_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // n_q
    width = cfg.intermediate_size if inter is None else inter
    proj = 2 * h * n_q * hd + 2 * h * n_kv * hd + 3 * h * width
    return 2.0 * proj + 4.0 * n_q * hd * (context + 1) / 2


def _width_for(budget: int, fixed: int, n_layers: int, cfg: Any, multiple: int = 64) -> int:
    """Largest MLP width (a multiple of ``multiple``) with fixed + n_layers * layer(width) <= budget."""
    base = _layer_params(cfg, inter=0)
    per_layer_room = (budget - fixed) / n_layers - base
    width = int(per_layer_room // (3 * cfg.hidden_size)) // multiple * multiple
    return max(0, min(width, cfg.intermediate_size))


def _width_for_flops(cap: float, n_layers: int, cfg: Any, context: int, multiple: int = 64) -> int:
    """Largest MLP width (a multiple of ``multiple``) with n_layers * layer_flops(width) <= cap."""
    if math.isinf(cap):
        return cfg.intermediate_size
    room = cap / n_layers - layer_flops(cfg, context=context, inter=0)
    width = int(room // (6 * cfg.hidden_size)) // multiple * multiple
    return max(0, min(width, cfg.intermediate_size))


def _fit_width(cfg: Any, n_layers: int, budget: int, fixed: int, cap: float, context: int) -> int:
    """The widest uniform MLP that meets both the parameter budget and the layer-FLOPs cap."""
    return min(_width_for(budget, fixed, n_layers, cfg), _width_for_flops(cap, n_layers, cfg, context))


def _layers_to_drop(cfg: Any, budget: int, cap: float, context: int) -> int:
    """Fewest whole layers to drop (at full width) to meet the parameter budget and the FLOPs cap."""
    L = cfg.num_hidden_layers
    k = max(0, math.ceil((estimate_params(cfg) - budget) / _layer_params(cfg)))
    if not math.isinf(cap):
        k = max(k, math.ceil(L - cap / layer_flops(cfg, context=context) - 1e-9))
    return k


def _domain_loss(model: Any, ids: Any, bf16: bool) -> float:
    import torch

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    return float(out.loss)


def prune(cfg: PruneConfig, *, progress: Progress = _quiet) -> dict[str, Any]:
    """Prune to ``cfg.target`` of the dense parameters; write a plain HF model to ``cfg.out``."""
    import torch

    t0 = time.monotonic()
    progress("loading the model")
    loaded = load(cfg.model)
    bf16 = use_bf16(cfg.bf16)
    model, tok = loaded.model, loaded.tokenizer
    dense_params = param_count(model)
    budget = int(cfg.target * dense_params)
    need_wanda = cfg.method == Method.WANDA
    structured = cfg.method in (Method.WIDTH, Method.AUTO) or cfg.heads_per_group is not None
    refits = cfg.reconstruct and structured
    dense = copy.deepcopy(model) if refits else None  # the refit's reference
    progress(f"measuring domain importance ({cfg.tokens} tokens of {cfg.domain})")
    ids = calib(loaded, cfg.domain, cfg.tokens, cfg.seq_len, per_file=cfg.calib_per_file)
    imp = importance.measure(model, ids, corpus=cfg.domain, wanda=need_wanda, bf16=bf16)
    record: dict[str, Any] = {
        "source": loaded.source if not loaded.provenance else loaded.provenance.get("source", loaded.source),
        "method": str(cfg.method),
        "target": cfg.target,
        "domain": cfg.domain,
        "dense_params": dense_params,
        "calibration_tokens": imp.tokens,
        "calib_per_file": cfg.calib_per_file,
        "precision": "bf16" if bf16 else "fp32",
    }
    kept_ids: list[int] | None = None
    if cfg.vocab:
        progress(f"scanning {cfg.vocab_tokens} domain tokens for the vocabulary")
        # the same file order as the calibration text, so that text is a prefix of this one
        scanned = corpus.tokens(tok, cfg.domain, "train", cfg.vocab_tokens, per_file=cfg.calib_per_file)
        used = sorted(set(scanned))
        tok, kept_ids = pr.trim_vocab(model, tok, used)
        remap = torch.full((len(loaded.tokenizer) + 1,), -1, dtype=torch.long)
        remap[torch.tensor(kept_ids)] = torch.arange(len(kept_ids))
        ids = remap[ids]  # the calibration text in the new ids (all of it is in the scanned domain)
        if bool((ids < 0).any()):
            raise UsageError("calibration tokens outside the scanned domain vocabulary; raise vocab_tokens")
        record["vocab"] = {"dense": len(loaded.tokenizer), "kept": len(kept_ids), "used_in_domain": len(used)}
    L = model.config.num_hidden_layers
    ctx = cfg.flops_context
    dense_flops = L * layer_flops(model.config, context=ctx)
    cap = (1.0 - cfg.min_layer_flops_cut) * dense_flops if cfg.min_layer_flops_cut > 0 else math.inf
    rep = model.config.num_attention_heads // model.config.num_key_value_heads
    chan = importance.channel_scores(imp, model, str(cfg.channel_score))  # of the dense MLPs
    record["channel_score"] = str(cfg.channel_score)
    o_rows = None
    kept = rc.Kept(layers=list(range(L)))
    if cfg.heads_per_group is not None:
        o_rows = pr.prune_heads(model, imp.heads, cfg.heads_per_group)
        kept.o_rows = o_rows
        record["heads_per_group"] = cfg.heads_per_group
    fixed = estimate_params(model.config) - L * _layer_params(model.config)
    if cfg.method == Method.WANDA:
        linear = sum(m.weight.numel() for n, m in model.named_modules() if n in imp.input_norms)
        sparsity = min(0.95, max(0.0, (dense_params - budget) / linear))
        zeroed = pr.wanda(model, imp.input_norms, sparsity)
        record.update(sparsity=round(sparsity, 4), zeroed=zeroed, effective_params=dense_params - zeroed)
    elif cfg.method in (Method.DEPTH, Method.RANDOM_DEPTH):
        k = _layers_to_drop(model.config, budget, cap, ctx)
        if k >= L:
            raise UsageError(f"--target {cfg.target} leaves no layer")
        drop = pr.lowest(imp.layers, k) if cfg.method == Method.DEPTH else pr.random_layers(L, k, cfg.seed)
        pr.drop_layers(model, drop)
        record["dropped_layers"] = drop
    elif cfg.method == Method.WIDTH:
        width = _fit_width(model.config, L, budget, fixed, cap, ctx)
        if width <= 0:
            raise UsageError(f"--target {cfg.target} leaves no MLP width")
        kept.channels = pr.shrink_mlp(model, chan, width)
        record["mlp_width"] = width
    else:  # AUTO: a small search over heads x depth x width, scored by domain loss on calibration text
        model, choice, kept = _search(
            model,
            imp,
            chan,
            ids,
            cfg,
            budget=budget,
            fixed=fixed,
            cap=cap,
            rep=rep,
            o_rows=o_rows,
            progress=progress,
        )
        record.update(choice)
    if dense is not None and (kept.channels is not None or kept.o_rows is not None):
        t1 = time.monotonic()
        progress(
            f"least-squares reconstruction ({cfg.reconstruct_mode}, {cfg.reconstruct_tokens} tokens "
            f"of {cfg.domain})"
        )
        rec_ids = calib(  # dense vocabulary
            loaded, cfg.domain, cfg.reconstruct_tokens, cfg.seq_len, per_file=cfg.calib_per_file
        )
        stats = rc.reconstruct(
            model,
            dense,
            rec_ids,
            kept,
            mode=str(cfg.reconstruct_mode),  # type: ignore[arg-type]
            ridge=cfg.reconstruct_ridge,
            bf16=bf16,
        )
        stats["reconstruct_s"] = round(time.monotonic() - t1, 1)
        record["reconstruct"] = stats
    else:
        record["reconstruct"] = None
    del dense
    if cfg.min_layer_flops_cut > 0:
        record["min_layer_flops_cut"] = cfg.min_layer_flops_cut
    record["flops_context"] = ctx
    record["layer_flops_ratio"] = round(
        model.config.num_hidden_layers * layer_flops(model.config, context=ctx) / dense_flops, 4
    )
    record["params"] = param_count(model)
    record["ratio"] = round(record["params"] / dense_params, 4)
    record["prune_s"] = round(time.monotonic() - t0, 1)
    record["config"] = {
        k: getattr(model.config, k)
        for k in (
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    if kept_ids is not None:
        (cfg.out / "vocab_ids.json").write_text(json.dumps(kept_ids))
    progress(f"saving to {cfg.out}")
    ex.save_hf(model, tok, cfg.out, record)
    torch.set_grad_enabled(True)
    return record


def _search(
    model: Any,
    imp: Any,
    chan: Any,
    ids: Any,
    cfg: PruneConfig,
    *,
    budget: int,
    fixed: int,
    cap: float,
    rep: int,
    o_rows: list[Any] | None,
    progress: Progress,
) -> tuple[Any, dict[str, Any], rc.Kept]:
    """``--method auto``: every mix of query heads per KV group (all, or one fewer when no
    ``--heads-per-group`` is given), dropped layers (0, 1/4, 1/2, 3/4, all of those needed at full
    width) and the widest MLP that then meets the parameter target and the layer-FLOPs cap; the mix
    with the lowest domain loss on (part of) the calibration text wins (scored before any
    least-squares reconstruction). Also returns what the winner kept of the dense model."""
    score_ids = ids[: max(1, min(len(ids), 8))]
    L = model.config.num_hidden_layers
    h, n_kv = model.config.hidden_size, model.config.num_key_value_heads
    if cfg.heads_per_group is not None:
        head_options = [cfg.heads_per_group]
    else:  # one query head fewer per group, where transformers accepts the head count
        head_options = [rep] + ([rep - 1] if rep > 1 and h % (n_kv * (rep - 1)) == 0 else [])
    tried: list[dict[str, Any]] = []
    best: tuple[float, Any, dict[str, Any], rc.Kept] | None = None
    for hpg in head_options:
        base, base_rows = model, o_rows
        if hpg != (cfg.heads_per_group or rep):
            base = copy.deepcopy(model)
            base_rows = pr.prune_heads(base, imp.heads, hpg)
        k_max = _layers_to_drop(base.config, budget, cap, cfg.flops_context)
        for k in sorted({0, k_max // 4, k_max // 2, (3 * k_max) // 4, k_max}):
            if k >= L:
                continue
            width = _fit_width(base.config, L - k, budget, fixed, cap, cfg.flops_context)
            if width < 64:
                continue
            cand = copy.deepcopy(base)
            drop = pr.lowest(imp.layers, k)
            keep_rows = [i for i in range(L) if i not in set(drop)]
            if k:
                pr.drop_layers(cand, drop)
            kept = rc.Kept(
                layers=keep_rows, o_rows=[base_rows[i] for i in keep_rows] if base_rows is not None else None
            )
            if width < cand.config.intermediate_size:
                kept.channels = pr.shrink_mlp(cand, chan[keep_rows], width)
            loss = _domain_loss(cand, score_ids, use_bf16(cfg.bf16))
            choice = {
                "dropped_layers": drop,
                "mlp_width": width,
                "heads_per_group": hpg,
                "calib_loss": round(loss, 4),
                "candidate_params": param_count(cand),
            }
            tried.append(choice)
            progress(
                f"candidate: {hpg} query heads per group, drop {k} layers, MLP width {width}: "
                f"domain loss {loss:.3f}"
            )
            if best is None or loss < best[0]:
                best = (loss, cand, choice, kept)
            else:
                del cand
    if best is None:
        raise UsageError(f"--target {cfg.target}: no depth/width mix fits")
    return best[1], {**best[2], "candidates": tried}, best[3]


def _vocab_ids(path: Path) -> list[int] | None:
    f = path / "vocab_ids.json"
    return read_json(f, "vocabulary map") if f.is_file() else None


def evaluate(cfg: EvalConfig, *, out: Path | None = None, progress: Progress = _quiet) -> dict[str, Any]:
    """Perplexity (domain and general held-out), selectivity, size and optionally llama.cpp speed,
    of every model in ``cfg.models`` next to the dense one."""
    from gpufleet.compress import evaluate as ev

    progress("loading the dense model")
    dense = load(cfg.dense)
    bf16 = use_bf16(cfg.bf16)
    texts = {}
    ref = {}
    for role, spec in (("domain", cfg.domain), ("general", cfg.general)):
        ids = corpus.tokens(dense.tokenizer, spec, "heldout", cfg.tokens)
        texts[role] = dense.tokenizer.decode(ids, skip_special_tokens=False)
        ref[role] = len(dense.tokenizer(texts[role], add_special_tokens=False)["input_ids"])
    rows: list[dict[str, Any]] = []
    tmp = (out or Path(".")) / "gguf"

    def row(name: str, loaded: Loaded, path: Path | None) -> dict[str, Any]:
        r: dict[str, Any] = {"model": name, "params": param_count(loaded.model)}
        seen: set[int] = set()
        nonzero = 0
        for prm in loaded.model.parameters():  # Wanda's zeros still count in "params"
            if id(prm) not in seen:
                seen.add(id(prm))
                nonzero += int(prm.count_nonzero())
        r["nonzero_params"] = nonzero
        for role in ("domain", "general"):
            progress(f"{name}: {role} perplexity")
            r[f"{role}_ppl"] = round(
                ev.perplexity(loaded.model, loaded.tokenizer, texts[role], ref_tokens=ref[role], bf16=bf16),
                4,
            )
        if path is not None:
            r["hf_bytes"] = ev.file_size(path)
        if cfg.speed:
            progress(f"{name}: llama.cpp Q8_0 speed")
            g = ex.write_gguf(
                loaded.model, loaded.tokenizer, tmp / f"{name}.q8_0.gguf", qtype="q8_0", source=dense.source
            )
            r["gguf_q8_0_bytes"] = g.stat().st_size
            r.update(ev.llama_cpp_speed(g))
        return r

    base = row("dense", dense, None)
    rows.append(base)
    for path in cfg.models:
        loaded = load(path)
        r = row(path.name, loaded, path)
        r["method"] = loaded.provenance.get("method")
        r["params_ratio"] = round(r["params"] / base["params"], 4)
        r["nonzero_ratio"] = round(r["nonzero_params"] / base["nonzero_params"], 4)
        for role in ("domain", "general"):
            r[f"{role}_ratio"] = round(r[f"{role}_ppl"] / base[f"{role}_ppl"], 4)
        s = ev.selectivity(r["domain_ratio"], r["general_ratio"])
        r["selectivity"] = round(s, 3) if s is not None else None
        if cfg.speed:
            r["decode_speedup"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
            r["prefill_speedup"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 3)
        rows.append(r)
        del loaded
    res = {"dense": dense.source, "tokens": cfg.tokens, "precision": "bf16" if bf16 else "fp32", "rows": rows}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(res, indent=1) + "\n")
        from gpufleet.compress.plots import plot_eval

        res["plot"] = str(plot_eval(rows, out / "eval.png"))
    return res


def export(
    model_dir: Path,
    out: Path,
    *,
    formats: tuple[str, ...] = ("hf", "f16", "q8_0"),
    check_tokens: int = 64,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Write the formats of ``model_dir`` under ``out``; check every GGUF's logits against the model."""
    import torch

    loaded = load(model_dir)
    res: dict[str, Any] = {"model": str(model_dir), "files": {}, "max_logit_diff": {}}
    src = loaded.provenance.get("source")
    text = "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value\n" * 4
    ids = torch.tensor([loaded.tokenizer(text, add_special_tokens=False)["input_ids"][:check_tokens]])
    for fmt in formats:
        if fmt == "hf":
            dst = ex.save_hf(loaded.model, loaded.tokenizer, out / "hf", loaded.provenance or None)
            vids = _vocab_ids(model_dir)
            if vids is not None:
                (dst / "vocab_ids.json").write_text(json.dumps(vids))
            res["files"]["hf"] = str(dst)
            continue
        if fmt not in ("f16", "q8_0"):
            raise UsageError(f"unknown export format {fmt!r} (hf, f16, q8_0)")
        progress(f"writing GGUF {fmt}")
        path = ex.write_gguf(
            loaded.model,
            loaded.tokenizer,
            out / f"model-{fmt}.gguf",
            qtype=fmt,  # type: ignore[arg-type]
            source=src,
        )
        back = ex.read_gguf_model(path, loaded.model.config)
        res["files"][fmt] = str(path)
        res["max_logit_diff"][fmt] = round(ex.max_logit_diff(loaded.model, back, ids), 5)
    (out / "export.json").write_text(json.dumps(res, indent=1) + "\n")
    return res
