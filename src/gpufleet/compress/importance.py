"""Importance of every prunable structure, measured on calibration text.

* **Layers**: Block Influence (ShortGPT), ``BI_i = 1 - E_t[cos(x_in, x_out)]`` of decoder layer i.
* **Attention heads**: mean L2 norm of each query head's output (the ``o_proj`` input slice), and
  per key/value group the sum of its query heads (GQA: a group is dropped or kept whole).
* **MLP channels**: mean |activation| at the ``down_proj`` input (Minitron, activation-based), and
  the channel's output energy: RMS activation x L2 norm of its ``down_proj`` column, what it writes to
  the residual stream (:func:`channel_scores`, the default pruning score).
* **Wanda**: per linear layer the L2 norm of each input feature over the calibration tokens
  (the score of weight ``W_ij`` is ``|W_ij| * ||X_j||``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Importance", "measure", "channel_scores", "CHANNEL_SCORES"]

CHANNEL_SCORES = ("out", "act")


@dataclass(kw_only=True, slots=True)
class Importance:
    """What :func:`measure` found on one corpus."""

    corpus: str
    """The corpus spec it was measured on."""
    tokens: int
    """Calibration tokens seen."""
    layers: list[float]
    """Block Influence per decoder layer."""
    heads: list[list[float]]
    """[layer][query head] activation norm."""
    groups: list[list[float]]
    """[layer][key/value group] sum of its query heads."""
    channels: Any
    """[layer, intermediate] mean |activation| (a torch tensor)."""
    channel_rms: Any = None
    """[layer, intermediate] root mean square activation at the ``down_proj`` input."""
    input_norms: dict[str, Any] = field(default_factory=dict)
    """Linear module name -> per input feature L2 norm (only with ``wanda=True``)."""

    def summary(self) -> dict[str, Any]:
        """JSON-friendly view (channels reduced to per-layer mean and quartiles)."""
        import torch

        ch = self.channels.float()
        q = torch.quantile(ch, torch.tensor([0.25, 0.5, 0.75]), dim=1).T
        return {
            "corpus": self.corpus,
            "tokens": self.tokens,
            "block_influence": [round(v, 6) for v in self.layers],
            "heads": [[round(v, 5) for v in row] for row in self.heads],
            "kv_groups": [[round(v, 5) for v in row] for row in self.groups],
            "channels_mean": [round(float(v), 6) for v in ch.mean(1)],
            "channels_quartiles": [[round(float(x), 6) for x in row] for row in q],
        }


def _hidden(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) else x


def measure(
    model: Any,
    batches: Any,
    *,
    corpus: str = "",
    wanda: bool = False,
    batch_size: int = 4,
    bf16: bool = True,
) -> Importance:
    """Run ``batches`` ([n, seq] token ids) through ``model`` with hooks and collect importances
    (forward under bf16 autocast unless ``bf16=False``; statistics accumulate in float64)."""
    import torch

    cfg = model.config
    layers = model.model.layers
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    L = len(layers)
    cos_sum = torch.zeros(L, dtype=torch.float64)
    head_sum = torch.zeros(L, n_heads, dtype=torch.float64)
    chan_sum = torch.zeros(L, cfg.intermediate_size, dtype=torch.float64)
    chan_sq = torch.zeros(L, cfg.intermediate_size, dtype=torch.float64)
    sq_norms: dict[str, Any] = {}
    count = [0]
    handles = []

    def layer_hook(i: int) -> Any:
        def hook(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
            x_in = args[0] if args else kwargs["hidden_states"]
            x_out = _hidden(out)
            cos = torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1)
            cos_sum[i] += cos.double().sum()

        return hook

    def oproj_hook(i: int) -> Any:
        def hook(mod: Any, args: Any) -> None:
            x = args[0].float()
            per_head = x.view(*x.shape[:-1], n_heads, head_dim).norm(dim=-1)
            head_sum[i] += per_head.double().sum(dim=(0, 1))

        return hook

    def down_hook(i: int) -> Any:
        def hook(mod: Any, args: Any) -> None:
            a = args[0].float()
            chan_sum[i] += a.abs().double().sum(dim=(0, 1))
            chan_sq[i] += (a * a).double().sum(dim=(0, 1))

        return hook

    def norm_hook(name: str) -> Any:
        def hook(mod: Any, args: Any) -> None:
            x = args[0].float()
            s = (x * x).double().sum(dim=(0, 1))
            sq_norms[name] = sq_norms[name] + s if name in sq_norms else s

        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(layer_hook(i), with_kwargs=True))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(oproj_hook(i)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(down_hook(i)))
        if wanda:
            for name, mod in layer.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    handles.append(mod.register_forward_pre_hook(norm_hook(f"model.layers.{i}.{name}")))
    try:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with torch.no_grad(), ctx:
            for b in range(0, batches.shape[0], batch_size):
                x = batches[b : b + batch_size]
                model(input_ids=x, use_cache=False)
                count[0] += x.numel()
    finally:
        for h in handles:
            h.remove()
    n = max(count[0], 1)
    bi = (1.0 - cos_sum / n).tolist()
    heads = (head_sum / n).tolist()
    per_group = n_heads // n_kv
    groups = [[sum(row[g * per_group : (g + 1) * per_group]) for g in range(n_kv)] for row in heads]
    return Importance(
        corpus=corpus,
        tokens=count[0],
        layers=bi,
        heads=heads,
        groups=groups,
        channels=(chan_sum / n).float(),
        channel_rms=(chan_sq / n).sqrt().float(),
        input_norms={k: v.sqrt().float() for k, v in sq_norms.items()},
    )


def channel_scores(imp: Importance, model: Any, kind: str = "out") -> Any:
    """[layer, intermediate] score of every MLP channel of ``model`` (the model ``imp`` was measured on):
    ``act`` the mean |activation| (Minitron); ``out`` the RMS activation times the L2 norm of the
    channel's ``down_proj`` column, the size of what the channel adds to the residual stream. On
    SmolLM2-135M cut to 1088 of 1536 channels, ``out`` left held-out Python loss 2.88 nats against
    3.14 for ``act`` (dense 2.42)."""
    import torch

    if kind == "act":
        return imp.channels
    if kind != "out":
        raise ValueError(f"unknown channel score {kind!r} (one of {', '.join(CHANNEL_SCORES)})")
    cols = torch.stack(
        [layer.mlp.down_proj.weight.detach().float().norm(dim=0) for layer in model.model.layers]
    )
    return imp.channel_rms * cols
