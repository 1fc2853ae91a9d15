"""``gpufleet serve profile``: fit a latency profile from a live server or a table (docs/serve-plan.md).

``register(app)`` adds the command to the ``serve`` group. Thin: parse flags (bad values are one-line
UsageErrors, exit 2), call :mod:`gpufleet.serve.plan.profile`, render. numpy loads inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpufleet.core.errors import UsageError

__all__ = ["register", "profile_command"]

Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{what}: values must be integers >= 1 (got {text!r})")
    return vals


def profile_command(
    url: Annotated[
        str | None, Opt("--url", help="Measure this OpenAI-compatible server (sweeps via serve bench).")
    ] = None,
    from_table: Annotated[
        Path | None, Opt("--from-table", help="CSV: phase,tp,batch,input_len,context,time_ms.")
    ] = None,
    out: Annotated[Path, Opt("--out", help="Profile file to write.")] = Path("profile.json"),
    model: Annotated[
        str | None, Opt("--model", help="Model name (default: from the server, or 'model').")
    ] = None,
    hardware: Annotated[
        str, Opt("--hardware", help="Hardware label, e.g. H100-80G or cpu-2core.")
    ] = "unknown",
    tp: Annotated[int, Opt("--tp", help="TP size of the measured server.")] = 1,
    inputs: Annotated[str, Opt("--inputs", help="Prefill sweep: input lengths.")] = "32,64,128,192",
    decode_inputs: Annotated[str, Opt("--decode-inputs", help="Decode sweep: input lengths.")] = "32,160",
    output: Annotated[int, Opt("--output", help="Decode sweep: output tokens per request.")] = 32,
    concurrency: Annotated[str, Opt("--concurrency", help="Decode sweep: concurrency levels.")] = "1,2,4,8",
    requests: Annotated[int, Opt("--requests", help="Requests per sweep level.")] = 4,
    max_batch: Annotated[
        int | None, Opt("--max-batch", help="Engine batch limit (default: detected/256).")
    ] = None,
    kv_capacity: Annotated[
        int, Opt("--kv-capacity", help="KV-cache tokens per instance (0: unlimited).")
    ] = 0,
    kv_bytes_per_token: Annotated[float, Opt("--kv-bytes-per-token", help="For the P->D KV transfer.")] = 0.0,
    runs_dir: Annotated[
        Path | None, Opt("--runs-dir", help="Keep each sweep level's bench files here.")
    ] = None,
    list_examples: Annotated[bool, Opt("--list", help="List the shipped example profiles.")] = False,
) -> None:
    """Fit latency models (prefill a + b·ΣL + c·ΣL²; decode a + b·Σctx + c·batch) for one model/GPU/TP."""
    from gpufleet.serve.plan import profile as pm

    if list_examples:
        for name in pm.example_profiles():
            p = pm.load_profile(name)
            typer.echo(f"{name}: {p.model} on {p.hardware}, TP {sorted(p.tps)} ({p.source}): {p.source_note}")
        return
    if (url is None) == (from_table is None):
        raise UsageError("give exactly one of --url (measure a server) or --from-table FILE")
    if tp < 1 or requests < 1 or output < 2 or kv_capacity < 0 or kv_bytes_per_token < 0:
        raise UsageError("--tp, --requests must be >= 1, --output >= 2, --kv-* >= 0")
    from gpufleet.core.paths import input_file, output_dir, output_file

    output_file(out, "--out")
    if runs_dir is not None:
        output_dir(runs_dir, "--runs-dir")
    if from_table is not None:
        input_file(from_table, "--from-table")
    sweeps = {
        "inputs": _ints(inputs, "--inputs"),
        "decode_inputs": _ints(decode_inputs, "--decode-inputs"),
        "concurrency": _ints(concurrency, "--concurrency"),
    }
    if from_table is not None:
        prof = pm.profile_from_table(
            from_table, model or "model", hardware, max_batch or 256, kv_capacity, kv_bytes_per_token
        )
    else:
        assert url is not None
        from gpufleet.serve.bench.levels import detect_model

        name = model or detect_model(url)[0] or "model"
        pre, dec, mb = pm.measure(
            url,
            name,
            **sweeps,
            output=output,
            requests=requests,
            out=runs_dir,
            log=lambda m: typer.echo(m, err=True),
        )
        if len(pre) < 2 or len(dec) < 2:
            raise UsageError(f"too few successful requests to fit ({len(pre)} prefill, {len(dec)} decode)")
        pc, pi = pm.fit_prefill(pre)
        dc, di = pm.fit_decode(dec)
        prof = pm.Profile(
            name,
            hardware,
            "measured",
            f"measured with gpufleet serve profile --url {url}",
            {tp: pm.TpProfile(tp, pc, dc, max_batch or mb, kv_capacity, 8192, {"prefill": pi, "decode": di})},
            kv_bytes_per_token,
        )
    prof.save(out)
    for t in prof.tps.values():
        typer.echo(
            f"TP{t.tp}: prefill ms = {t.prefill.a:.4g} + {t.prefill.b:.4g}·ΣL + {t.prefill.c:.4g}·ΣL² "
            f"(R² {t.fit.get('prefill', {}).get('r2', '-')}); decode ms = {t.decode.a:.4g} + "
            f"{t.decode.b:.4g}·Σctx + {t.decode.c:.4g}·batch (R² {t.fit.get('decode', {}).get('r2', '-')}); "
            f"max_batch {t.max_batch}"
        )
    typer.echo(f"profile: {out}")
