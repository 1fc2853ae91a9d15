"""Figures of ``gpufleet compress`` (matplotlib, imported lazily, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_analysis", "plot_eval"]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_analysis(domain: Any, general: Any, path: Path) -> Path:
    """Where the domain lives: Block Influence per layer, head and MLP-channel importance, domain
    against general (ratios above 1: the domain leans on it more)."""
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    x = np.arange(len(domain.layers))
    ax[0].bar(x - 0.2, domain.layers, 0.4, label=f"domain ({domain.corpus})")
    ax[0].bar(x + 0.2, general.layers, 0.4, label=f"general ({general.corpus})")
    ax[0].set(title="Block Influence per layer (ShortGPT)", xlabel="layer", ylabel="1 - cos(in, out)")
    ax[0].legend(fontsize=8)
    ratio = np.array(domain.heads) / np.maximum(np.array(general.heads), 1e-9)
    im = ax[1].imshow(ratio.T, aspect="auto", cmap="coolwarm", vmin=0.5, vmax=1.5)
    ax[1].set(title="head activation, domain / general", xlabel="layer", ylabel="query head (grouped by KV)")
    fig.colorbar(im, ax=ax[1])
    ch_ratio = (domain.channels / general.channels.clamp_min(1e-9)).numpy()
    q = np.quantile(ch_ratio, [0.1, 0.5, 0.9], axis=1)
    ax[2].fill_between(x, q[0], q[2], alpha=0.3, label="10-90%")
    ax[2].plot(x, q[1], label="median")
    ax[2].axhline(1.0, color="k", lw=0.5)
    ax[2].set(title="MLP channel activation, domain / general", xlabel="layer")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_eval(rows: list[dict[str, Any]], path: Path) -> Path:
    """Quality against size per method: domain and general perplexity ratio vs parameter ratio."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows[1:]:
        x = r.get("params_ratio", 1.0)
        ax.scatter([x], [r["domain_ratio"]], marker="o", color="tab:blue")
        ax.scatter([x], [r["general_ratio"]], marker="x", color="tab:red")
        ax.annotate(r["model"], (x, r["domain_ratio"]), fontsize=7)
    ax.scatter([], [], marker="o", color="tab:blue", label="domain ppl / dense")
    ax.scatter([], [], marker="x", color="tab:red", label="general ppl / dense")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set(xlabel="parameters / dense", ylabel="perplexity / dense", yscale="log", title="quality vs size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
