"""P8: domain-selective compression of SmolLM2-135M-Instruct for Python code, side by side at -25%
parameters, in one run directory:

* ShortGPT: drop the lowest-Block-Influence layers, no healing;
* Wanda: unstructured |W|*||X|| at the sparsity that zeroes 25% of the parameters (quality only);
* random layer drop (the same number of layers as ShortGPT);
* gpufleet's best: vocabulary trimmed to the domain + a heads x depth x width search on domain loss
  under a decoder-layer FLOPs cut (``--method auto --vocab --vocab-tokens 1000000
  --min-layer-flops-cut 0.22``, v3; since v4 ``compress prune`` also refits every layer's
  ``down_proj`` by least squares after the cut, its default ``--reconstruct``; ``--best-flags`` to
  change), then
  healed by distillation from the dense teacher as a supervised ``gpufleet compress heal`` run
  (``--heal-steps``; the CPU time it took is recorded).

Quality: perplexity per dense-tokenizer token on held-out files (domain: Python stdlib source;
general: GNU info manuals), bf16 forward passes, selectivity = (general ratio - 1) / (domain ratio - 1).
Speed: llama.cpp (llama-cpp-python, 2 threads) prefill and decode tok/s of Q8_0 GGUFs, dense and
compressed measured in alternation (``--speed-rounds`` rounds), medians.

Phases run one at a time (``--phase prune|heal|eval|speed|all``); heavy phases should run under
``flock /tmp/gpufleet_heavy.lock nice -n 5``. Results merge into benchmarks/results/p8_compress.json.

    .venv/bin/python benchmarks/bench_p8_compress.py --work runs/p8 --phase all --heal-steps 100

v3 was measured phase by phase (prune --variants best --calib-tokens 4096; OMP_NUM_THREADS=1 heal
--heal-steps 167 --heal-lr 3e-4; eval --eval-tokens 4096; speed --speed-rounds 7 --speed-repeats 3
with --speed-threads 2 and 1; serve), see docs/benchmarks.md. v4 is v3 with the least-squares
reconstruction (prune --best-flags "... --reconstruct-ridge R"; heal and eval as v3; v3's figures
are kept under "v3" in the results JSON, its files under runs/p8/v3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RESULTS = Path(__file__).resolve().parent / "results" / "p8_compress.json"
GOALS = {"domain_ratio_max": 1.25, "selectivity_min": 1.3, "speedup_min": 1.25, "max_rate_gain_min": 1.2}
VARIANTS = {  # name -> prune CLI flags
    "shortgpt": ["--method", "depth"],
    "wanda": ["--method", "wanda"],
    "random": ["--method", "random-depth", "--seed", "0"],
    # --calib-per-file 0: calibration and vocabulary from the train files in sorted order, as measured
    # for v4/v5; the spread default (256) gives a better unhealed model but no better healed domain
    # and a lower selectivity (P8 v6, docs/benchmarks.md)
    "best": (
        "--method auto --vocab --min-layer-flops-cut 0.22 --vocab-tokens 1000000 --calib-per-file 0"
    ).split(),
}


def _key(phase: str, model: str) -> str:
    """Where ``phase``'s result for ``model`` is kept: the issue's model (best-healed) under the
    phase's own name, any other under ``phase:MODEL``."""
    return phase if model == "best-healed" else f"{phase}:{model}"


def _merge(update: dict[str, Any]) -> dict[str, Any]:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    cur = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    cur.update(update)
    cur["host"] = {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}
    RESULTS.write_text(json.dumps(cur, indent=1) + "\n")
    return cur


def _cli(*args: str) -> dict[str, Any]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "compress", *args, "--json"],
        capture_output=True,
        text=True,
    )
    if p.returncode:
        raise SystemExit(f"compress {args[0]} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout)
    out["_wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dense_dir(work: Path) -> Path:
    d = work / "dense"
    if not (d / "model.safetensors").is_file():
        from gpufleet.compress.export import save_hf
        from gpufleet.compress.model import load

        loaded = load(None)
        # the dense HF copy remembers its GGUF: GGUF exports copy the pre-tokenizer and template from it
        save_hf(loaded.model, loaded.tokenizer, d, {"source": loaded.source, "method": "dense"})
    return d


def phase_prune(work: Path, target: float, tokens: int, variants: list[str], best_as: str = "best") -> None:
    dense = dense_dir(work)
    cur = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    recs = dict(cur.get("prune", {}))  # variants not rerun keep their records
    for variant in variants:
        flags = VARIANTS[variant]
        name = best_as if variant == "best" else variant
        load0 = os.getloadavg()[0]
        rec = _cli(
            "prune",
            "--model",
            str(dense),
            "--target",
            str(target),
            "--tokens",
            str(tokens),
            "-o",
            str(work / name),
            *flags,
        )
        rec["loadavg_start"] = load0
        recs[name] = {k: v for k, v in rec.items() if k != "candidates"} | {
            "candidates": rec.get("candidates")
        }
        print(f"prune {name}: ratio {rec['ratio']} in {rec['_wall_s']} s", flush=True)
    _merge({"prune": recs, "target": target, "calibration_tokens": tokens})


def phase_heal(
    work: Path,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    name: str = "best-healed",
    ce_weight: float = 0.0,
    pool_per_file: int = 1024,
    student: str = "best",
) -> None:
    dense = dense_dir(work)
    load0 = os.getloadavg()
    t0 = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "compress",
            "heal",
            str(work / student),
            "--teacher",
            str(dense),
            "-o",
            str(work / name),
            "--steps",
            str(steps),
            "--batch",
            str(batch),
            "--seq-len",
            str(seq_len),
            "--lr",
            str(lr),
            "--ce-weight",
            str(ce_weight),
            "--pool-per-file",
            str(pool_per_file),
            "--checkpoint-every",
            "25",
        ],
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(f"heal failed with exit {p.returncode}")
    res = json.loads((work / f"{name}.run" / "heal_result.json").read_text())
    _merge(
        {
            _key("heal", name): {
                "student": student,
                "steps": steps,
                "batch": batch,
                "seq_len": seq_len,
                "lr": lr,
                "ce_weight": ce_weight,  # the kl_* figures below are the mixed loss when it is > 0
                "pool_per_file": pool_per_file,
                "wall_s": round(time.monotonic() - t0, 1),
                "cpu_s": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1),
                "train_s": res["train_s"],
                "kl_first": res["losses"][0][1],
                "kl_last": res["losses"][-1][1],
                "kl_last10_mean": round(
                    sum(v for _, v in res["losses"][-10:]) / min(10, len(res["losses"])), 4
                ),
                "loadavg_start": load0,
                "loadavg_end": os.getloadavg(),
                "omp_threads": os.environ.get("OMP_NUM_THREADS", "gpufleet run's default (CPUs / workers)"),
            }
        }
    )


def phase_eval(work: Path, tokens: int, names: list[str]) -> None:
    """Evaluate ``names`` next to the dense model; their rows replace those of the same name in the
    results (the dense row too: same text, same model, so the other rows stay comparable)."""
    dense = dense_dir(work)
    models = [str(work / n) for n in names if (work / n).is_dir()]
    load0 = os.getloadavg()
    res = _cli("eval", *models, "--dense", str(dense), "--tokens", str(tokens), "-o", str(work / "eval"))
    # rows are comparable only at one precision (bf16 where the CPU has it natively, else fp32)
    key = "eval" if res["precision"] == "bf16" else f"eval:{res['precision']}"
    cur = json.loads(RESULTS.read_text()).get(key, {}) if RESULTS.is_file() else {}
    if cur.get("tokens") == tokens:
        new = {r["model"] for r in res["rows"]}
        res["rows"] = [r for r in cur.get("rows", []) if r["model"] not in new] + res["rows"]
        order = ["dense", "shortgpt", "wanda", "random", "best", "best-healed"]
        res["rows"].sort(key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    res["loadavg_start"] = load0
    res["cpu"] = _cpu_model()
    _merge({key: res})


def phase_speed(
    work: Path,
    rounds: int,
    repeats: int = 1,
    threads: int = 2,
    reuse: bool = False,
    model: str = "best-healed",
) -> None:
    """Dense and ``model`` Q8_0 in alternation, ``rounds`` rounds of ``repeats`` (median inside a
    round); ``reuse`` keeps GGUFs already exported. Earlier runs stay in ``speed_runs`` (a model other
    than best-healed: under ``speed:MODEL``)."""
    from gpufleet.compress.evaluate import llama_cpp_speed

    out = {}
    for name in ("dense", model):
        src = work / name
        if not src.is_dir():
            continue
        gguf = work / f"export-{name}" / "model-q8_0.gguf"
        if reuse and gguf.is_file() and gguf.stat().st_mtime > (src / "model.safetensors").stat().st_mtime:
            prev = json.loads((work / f"export-{name}" / "export.json").read_text())
            out[name] = prev
            continue
        out[name] = _cli("export", str(src), "-o", str(work / f"export-{name}"), "--formats", "q8_0")
    paths = {n: work / f"export-{n}" / "model-q8_0.gguf" for n in out}
    samples: dict[str, dict[str, list[float]]] = {n: {"prefill_tok_s": [], "decode_tok_s": []} for n in paths}
    loads = []
    for _ in range(rounds):  # alternate, so a load change on the shared host hits both alike
        for n, p in paths.items():
            s = llama_cpp_speed(p, repeats=repeats, threads=threads)
            for k, v in s.items():
                samples[n][k].append(v)
            loads.append(os.getloadavg()[0])
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    speed = {
        "rounds": rounds,
        "repeats_per_round": repeats,
        "threads": threads,
        "samples": samples,
        "median": med,
        "loadavg": loads,
        "gguf_bytes": {n: p.stat().st_size for n, p in paths.items()},
        "logit_check": {n: o["max_logit_diff"] for n, o in out.items()},
    }
    speed["cpu"] = _cpu_model()
    if "dense" in med and model in med:
        speed["prefill_speedup"] = round(med[model]["prefill_tok_s"] / med["dense"]["prefill_tok_s"], 3)
        speed["decode_speedup"] = round(med[model]["decode_tok_s"] / med["dense"]["decode_tok_s"], 3)
        # per round (both measured back to back), the ratio; its median is robust to a neighbour's burst
        for k in ("prefill", "decode"):
            ratios = [
                b / d
                for d, b in zip(samples["dense"][f"{k}_tok_s"], samples[model][f"{k}_tok_s"], strict=True)
            ]
            speed[f"{k}_speedup_paired_median"] = round(statistics.median(ratios), 3)
    cur = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if model != "best-healed":
        _merge({_key("speed", model): [*cur.get(_key("speed", model), []), speed]})
        return
    runs = cur.get("speed_runs", [])
    _merge({"speed": speed, "speed_runs": [*runs, speed]})


def phase_serve(
    work: Path, slo: str, workload: str, duration: int, max_rate: float, model: str = "best-healed"
) -> None:
    """`gpufleet serve bench --find-max-rate` against llama.cpp's server, dense then ``model`` (Q8_0,
    one server thread, same workload and SLO); the gain scales the planner profile. A model other
    than best-healed is recorded under ``serve:MODEL``, with its own ``speed:MODEL`` run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gpufleet.compress.serving import scaled_profile
    from support.llama import LlamaServer

    caps = {}
    for name in ("dense", model):
        gguf = work / f"export-{name}" / "model-q8_0.gguf"
        if not gguf.is_file():
            raise SystemExit(f"{gguf} missing: run --phase speed first")
        with LlamaServer(gguf, n_ctx=1024, n_threads=1, log_dir=work / "logs") as srv:
            out = work / f"serve-{name}"
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpufleet.cli.main",
                    "serve",
                    "bench",
                    "--url",
                    srv.url,
                    "--model",
                    "smollm2",
                    "--api",
                    "completions",
                    "--workload",
                    workload,
                    "--slo",
                    slo,
                    "--find-max-rate",
                    "--duration",
                    str(duration),
                    "--max-rate",
                    str(max_rate),
                    "--tokenizer",
                    str(work / "dense"),
                    "--out",
                    str(out),
                    "--no-progress",
                    "--no-plot",
                    "--max-lag-ms",
                    "250",
                ],
                capture_output=True,
                text=True,
            )
            if p.returncode not in (0, 1):
                raise SystemExit(f"serve bench failed ({p.returncode}): {p.stderr[-3000:]}")
            cap = json.loads((out / "capacity.json").read_text())
            caps[name] = {
                k: cap.get(k) for k in ("max_rate", "stable", "limited_by", "slo", "target_attainment")
            }
            caps[name]["points"] = [
                {k: pt.get(k) for k in ("offered_rate", "achieved_rate", "attainment", "output_tokens_per_s")}
                for pt in cap.get("points", [])
            ]
            print(f"serve {name}: max rate {cap.get('max_rate')} req/s ({cap.get('limited_by')})", flush=True)
    serve: dict[str, Any] = {"workload": workload, "slo": slo, "duration_s": duration, "capacity": caps}
    if caps["dense"]["max_rate"]:
        serve["max_rate_gain"] = round(caps[model]["max_rate"] / caps["dense"]["max_rate"], 3)
    cur = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    sp = cur.get("speed", {}) if model == "best-healed" else (cur.get(_key("speed", model)) or [{}])[-1]
    if "prefill_speedup" in sp:
        from importlib import resources

        dense_prof = json.loads(
            (resources.files("gpufleet.serve.plan") / "data" / "profiles" / "llama3-8b-h100.json").read_text()
        )
        cfg_d = json.loads((work / "dense" / "config.json").read_text())
        cfg_c = json.loads((work / model / "config.json").read_text())

        def kv(c: dict[str, Any]) -> int:
            return c["num_hidden_layers"] * c["num_key_value_heads"] * c.get("head_dim", 64)

        prof = scaled_profile(
            dense_prof,
            prefill_speedup=sp["prefill_speedup"],
            decode_speedup=sp["decode_speedup"],
            kv_ratio=kv(cfg_c) / kv(cfg_d),
            note="P8: SmolLM2 speed-ups applied to an 8B profile",
        )
        (work / "profile-compressed.json").write_text(json.dumps(prof, indent=1))
        plans = {}
        for name, ref in (("dense", "llama3-8b-h100"), ("compressed", str(work / "profile-compressed.json"))):
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpufleet.cli.main",
                    "serve",
                    "plan",
                    "--profile",
                    ref,
                    "--traffic",
                    "rate=200;in=fixed:512;out=fixed:128",
                    "--mode",
                    "aggregated",
                    "--out",
                    str(work / f"plan-{name}"),
                    "--json",
                ],
                capture_output=True,
                text=True,
            )
            if p.returncode == 0:
                pl = json.loads(p.stdout)
                plans[name] = {"gpus": pl["gpus"], "goodput_per_gpu": pl["predicted"]["goodput_per_gpu"]}
        serve["plan_200rps_512in_128out"] = plans
    _merge({_key("serve", model): serve})


def report() -> str:
    """The markdown section of docs/benchmarks.md from the results JSON (figures as measured)."""
    r = json.loads(RESULTS.read_text())
    lines = [
        "| model | method | params | domain ppl | general ppl | domain x | general x | selectivity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r.get("eval", {}).get("rows", []):
        lines.append(
            f"| {row['model']} | {row.get('method') or 'dense'} | {row['params'] / 1e6:.1f} M"
            f" ({row.get('params_ratio', 1.0):.3f}, nonzero {row.get('nonzero_ratio', 1.0):.3f}) |"
            f" {row['domain_ppl']:.2f} | {row['general_ppl']:.2f} |"
            f" {row.get('domain_ratio', 1.0):.3f} | {row.get('general_ratio', 1.0):.3f} |"
            f" {row.get('selectivity')} |"
        )
    sp = r.get("speed", {})
    if sp:
        lines += [
            "",
            "| llama.cpp Q8_0, 2 threads (median of rounds) | prefill tok/s | decode tok/s | GGUF MB |",
            "|---|---|---|---|",
        ]
        for n, m in sp["median"].items():
            lines.append(
                f"| {n} | {m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f} |"
                f" {sp['gguf_bytes'][n] / 1e6:.1f} |"
            )
        lines.append(f"| speed-up | {sp.get('prefill_speedup')} | {sp.get('decode_speedup')} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/p8"))
    ap.add_argument(
        "--phase", default="all", choices=["prune", "heal", "eval", "speed", "serve", "all", "report"]
    )
    ap.add_argument("--target", type=float, default=0.75)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="prune phase: which variants")
    ap.add_argument(
        "--best-flags",
        default=" ".join(VARIANTS["best"]),
        help="prune phase: the `compress prune` flags of the best variant (one string)",
    )
    ap.add_argument(
        "--eval-models", default="shortgpt,wanda,random,best,best-healed", help="eval phase: which models"
    )
    ap.add_argument("--heal-steps", type=int, default=167)
    ap.add_argument("--heal-batch", type=int, default=4)
    ap.add_argument("--heal-seq-len", type=int, default=256)
    ap.add_argument("--heal-lr", type=float, default=3e-4)
    ap.add_argument(
        "--heal-ce-weight", type=float, default=0.5, help="heal phase: `compress heal --ce-weight`"
    )
    ap.add_argument(
        "--heal-pool-per-file", type=int, default=1024, help="heal phase: `compress heal --pool-per-file`"
    )
    ap.add_argument("--best-as", default="best", help="prune phase: the best model's name under --work")
    ap.add_argument("--heal-from", default="best", help="heal phase: the pruned model's name under --work")
    ap.add_argument("--heal-name", default="best-healed", help="heal phase: output model name under --work")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--speed-rounds", type=int, default=5)
    ap.add_argument("--speed-repeats", type=int, default=1, help="measurements per model per round (median)")
    ap.add_argument("--speed-threads", type=int, default=2)
    ap.add_argument("--speed-reuse", action="store_true", help="reuse Q8_0 exports newer than the model")
    ap.add_argument(
        "--speed-model", default="best-healed", help="speed and serve phases: the model compared with dense"
    )
    ap.add_argument("--slo", default="ttft=2s,tpot=100ms")
    ap.add_argument("--workload", default="in=fixed:128;out=fixed:32")
    ap.add_argument("--serve-duration", type=int, default=20)
    ap.add_argument("--serve-max-rate", type=float, default=8.0)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.phase == "report":
        print(report())
        return
    VARIANTS["best"] = shlex.split(a.best_flags)
    if a.phase in ("prune", "all"):
        phase_prune(a.work, a.target, a.calib_tokens, a.variants.split(","), a.best_as)
    if a.phase in ("heal", "all"):
        phase_heal(
            a.work,
            a.heal_steps,
            a.heal_batch,
            a.heal_seq_len,
            a.heal_lr,
            a.heal_name,
            a.heal_ce_weight,
            a.heal_pool_per_file,
            a.heal_from,
        )
    if a.phase in ("eval", "all"):
        phase_eval(a.work, a.eval_tokens, a.eval_models.split(","))
    if a.phase in ("speed", "all"):
        phase_speed(a.work, a.speed_rounds, a.speed_repeats, a.speed_threads, a.speed_reuse, a.speed_model)
    if a.phase in ("serve", "all"):
        phase_serve(a.work, a.slo, a.workload, a.serve_duration, a.serve_max_rate, a.speed_model)
    print(json.dumps(json.loads(RESULTS.read_text()), indent=1)[:4000])


if __name__ == "__main__":
    main()
