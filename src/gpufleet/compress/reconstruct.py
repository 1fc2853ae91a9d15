"""Layer-wise least-squares reconstruction after structured pruning (as in FLAP's bias compensation,
ZipLM, SlimGPT): once MLP channels (or attention heads) are gone, refit the projection that reads
them, ``down_proj`` (``o_proj``), so that the layer writes to the residual stream what the dense layer
wrote, on calibration activations of the domain:

    W' = argmin_W' ||X_K W'^T - X W^T||^2 + lambda ||W'||^2  =  W G[:, K] (G[K, K] + lambda I)^-1

with ``X`` the dense projection's inputs (all channels), ``K`` the kept channels, ``G = X^T X``
accumulated in float64, and ``lambda = ridge x mean(diag G[K, K])``. The removed channels' part of the
output that is linear in the kept ones moves onto them; nothing else changes (widths, speed).

Two ways to feed the layers (``mode``):

* ``sequential``: the pruned model's own residual stream, layer by layer (each layer refitted before
  the next sees its output); the target is the dense projection applied to those same inputs. The
  fit sees the inputs the pruned layer will see.
* ``dense``: the dense model's residual stream (every layer independently, as in FLAP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Kept", "Mode", "refit", "reconstruct", "MODES"]

Mode = Literal["sequential", "dense"]
MODES: tuple[Mode, ...] = ("sequential", "dense")


@dataclass(kw_only=True, slots=True)
class Kept:
    """What a pruned model kept of its dense source, per pruned decoder layer."""

    layers: list[int]
    """Dense index of every pruned layer, in order."""
    channels: list[Any] | None = None
    """Per pruned layer the kept MLP channels (dense numbering, sorted LongTensor); None: MLP untouched."""
    o_rows: list[Any] | None = None
    """Per pruned layer the kept ``o_proj`` input rows (the kept query heads' slices); None: heads
    untouched."""


def refit(weight: Any, gram: Any, keep: Any, ridge: float) -> Any:
    """The ridge least-squares refit of a projection ``weight`` [out, in] to its kept inputs ``keep``,
    given the Gram matrix ``gram`` [in, in] of its dense inputs: ``W G[:, K] (G[K, K] + lambda I)^-1``,
    solved in float64 (``lambda = ridge x`` the mean diagonal of ``G[K, K]``). Returns [out, |K|]."""
    import torch

    g = gram.double()
    gkk = g.index_select(0, keep).index_select(1, keep)
    lam = ridge * float(gkk.diagonal().mean()) if len(keep) else 0.0
    a = gkk + lam * torch.eye(len(keep), dtype=torch.float64)
    rhs = g.index_select(0, keep) @ weight.double().T  # [K, out] = X_K^T X W^T
    chol, info = torch.linalg.cholesky_ex(a)
    sol = torch.cholesky_solve(rhs, chol) if int(info) == 0 else torch.linalg.lstsq(a, rhs).solution
    return sol.T.to(weight.dtype).contiguous()


class _Stop(Exception):
    pass


def _layer_inputs(model: Any, batches: Any, batch_size: int, bf16: bool) -> list[tuple[Any, dict[str, Any]]]:
    """Hidden states and keyword arguments (rotary embeddings, mask) at the first decoder layer, per batch."""
    import torch

    got: list[tuple[Any, dict[str, Any]]] = []

    def hook(mod: Any, args: Any, kwargs: Any) -> None:
        h = args[0] if args else kwargs.pop("hidden_states")
        got.append((h.detach().float(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for b in range(0, batches.shape[0], batch_size):
                try:
                    model(input_ids=batches[b : b + batch_size], use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return got


class _Gram:
    """``X^T X`` of a module's input, accumulated in float64 (products in float32)."""

    def __init__(self, width: int) -> None:
        import torch

        self.g = torch.zeros(width, width, dtype=torch.float64)

    def add(self, x: Any) -> None:
        import torch

        with torch.autocast("cpu", enabled=False):  # the hooks run under the forward's autocast
            x = x.reshape(-1, x.shape[-1]).float()
            self.g += (x.T @ x).double()


def _run(layer: Any, stream: list[tuple[Any, dict[str, Any]]], bf16: bool, *, keep: bool) -> list[Any]:
    import torch

    outs = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for h, kw in stream:
            out = layer(h, **kw)
            out = out[0] if isinstance(out, tuple) else out
            if keep:
                outs.append(out.float())
    return outs


def reconstruct(
    pruned: Any,
    dense: Any,
    batches: Any,
    kept: Kept,
    *,
    mode: Mode = "sequential",
    ridge: float = 1e-4,
    bf16: bool = True,
    batch_size: int = 8,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Refit ``down_proj`` (where ``kept.channels``) and ``o_proj`` (where ``kept.o_rows``) of every
    layer of ``pruned`` in place, on ``batches`` ([n, seq] token ids in the DENSE model's vocabulary).
    Returns per-layer relative errors of the refitted projection's output on the calibration tokens,
    before (plain slicing) and after."""
    import torch

    if mode not in MODES:
        raise ValueError(f"unknown reconstruction mode {mode!r}")
    layers = pruned.model.layers
    if len(kept.layers) != len(layers):
        raise ValueError("kept.layers must name the dense source of every pruned layer")
    stream = _layer_inputs(dense, batches, batch_size, bf16)
    stats: dict[str, Any] = {"mode": mode, "ridge": ridge, "tokens": int(batches.numel()), "layers": []}
    src_of = {s: j for j, s in enumerate(kept.layers)}
    order = range(len(dense.model.layers)) if mode == "dense" else kept.layers
    for s in order:
        j = src_of.get(s)
        d_layer = dense.model.layers[s]
        if j is None:  # dense mode: a dropped layer still moves the dense stream on
            stream = list(zip(_run(d_layer, stream, bf16, keep=True), [kw for _, kw in stream], strict=True))
            continue
        p_layer = layers[j]
        rec: dict[str, Any] = {"layer": j, "source": s}
        rows = kept.o_rows[j] if kept.o_rows is not None else None
        chans = kept.channels[j] if kept.channels is not None else None
        # o_proj: Gram of the dense attention output on this stream
        if rows is not None:
            g_o = _Gram(d_layer.self_attn.o_proj.in_features)
            h = d_layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, g=g_o: g.add(a[0]))
            try:
                _run(d_layer, stream, bf16, keep=False)
            finally:
                h.remove()
            w = d_layer.self_attn.o_proj.weight.detach()
            rec["o_proj"] = _apply(p_layer.self_attn.o_proj, w, g_o.g, rows, ridge)
        # down_proj: Gram of the dense MLP's intermediate activations on the MLP input the pruned layer
        # sees (sequential) or the dense layer sees (dense)
        if chans is not None:
            d_mlp = d_layer.mlp
            g_d = _Gram(d_mlp.down_proj.in_features)

            def on_mlp(m: Any, a: Any, d_mlp: Any = d_mlp, g_d: _Gram = g_d) -> None:
                x = a[0]
                g_d.add(d_mlp.act_fn(d_mlp.gate_proj(x)) * d_mlp.up_proj(x))

            watched = d_layer if mode == "dense" else p_layer
            h = watched.mlp.register_forward_pre_hook(on_mlp)
            try:
                _run(watched, stream, bf16, keep=False)
            finally:
                h.remove()
            w = d_mlp.down_proj.weight.detach()
            rec["down_proj"] = _apply(p_layer.mlp.down_proj, w, g_d.g, chans, ridge)
        stats["layers"].append(rec)
        nxt = d_layer if mode == "dense" else p_layer
        stream = list(zip(_run(nxt, stream, bf16, keep=True), [kw for _, kw in stream], strict=True))
        if progress is not None:
            progress(f"reconstructed layer {j + 1}/{len(layers)}")
    del stream
    errs = [r["down_proj"]["rel_err_after"] for r in stats["layers"] if "down_proj" in r]
    if errs:
        before = [r["down_proj"]["rel_err_before"] for r in stats["layers"] if "down_proj" in r]
        stats["down_proj_rel_err_mean"] = {
            "before": round(sum(before) / len(before), 5),
            "after": round(sum(errs) / len(errs), 5),
        }
    torch.set_grad_enabled(True)
    return stats


def _rel_err(w_full: Any, w_kept: Any, g: Any, keep: Any) -> float:
    """||X_K w_kept^T - X w_full^T||_F / ||X w_full^T||_F from the Gram matrix alone."""
    import torch

    w = w_full.double()
    d = torch.zeros_like(w)
    d[:, keep] = w_kept.double()
    d = d - w  # the error is X (d)^T
    num = torch.einsum("oi,ij,oj->", d, g, d)
    den = torch.einsum("oi,ij,oj->", w, g, w)
    return float((num.clamp_min(0) / den.clamp_min(1e-30)).sqrt())


def _apply(lin: Any, w_dense: Any, g: Any, keep: Sequence[int] | Any, ridge: float) -> dict[str, float]:
    import torch

    keep = torch.as_tensor(keep, dtype=torch.long)
    before = _rel_err(w_dense, w_dense.index_select(1, keep), g, keep)
    new = refit(w_dense, g, keep, ridge)
    after = _rel_err(w_dense, new, g, keep)
    with torch.no_grad():
        lin.weight.data = new.to(lin.weight.dtype)
    return {"rel_err_before": round(before, 5), "rel_err_after": round(after, 5)}
