"""P8: domain-selective compression of SmolLM2-135M-Instruct for Python code, side by side at -25%
parameters, in one run directory:

* ShortGPT: drop the lowest-Block-Influence layers, no healing;
* Wanda: unstructured |W|*||X|| at the sparsity that zeroes 25% of the parameters (quality only);
* random layer drop (the same number of layers as ShortGPT);
* gpufleet's best: vocabulary trimmed to the domain + a depth x width search on domain loss
  (``--method auto --vocab``), then healed by distillation from the dense teacher as a supervised
  ``gpufleet compress heal`` run (``--heal-steps``; the CPU time it took is recorded).

Quality: perplexity per dense-tokenizer token on held-out files (domain: Python stdlib source;
general: GNU info manuals), bf16 forward passes, selectivity = (general ratio - 1) / (domain ratio - 1).
Speed: llama.cpp (llama-cpp-python, 2 threads) prefill and decode tok/s of Q8_0 GGUFs, dense and
compressed measured in alternation (``--speed-rounds`` rounds), medians.

Phases run one at a time (``--phase prune|heal|eval|speed|all``); heavy phases should run under
``flock /tmp/gpufleet_heavy.lock nice -n 5``. Results merge into benchmarks/results/p8_compress.json.

    .venv/bin/python benchmarks/bench_p8_compress.py --work runs/p8 --phase all --heal-steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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
    "best": ["--method", "auto", "--vocab"],
}


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


def dense_dir(work: Path) -> Path:
    d = work / "dense"
    if not (d / "model.safetensors").is_file():
        from gpufleet.compress.export import save_hf
        from gpufleet.compress.model import load

        loaded = load(None)
        # the dense HF copy remembers its GGUF: GGUF exports copy the pre-tokenizer and template from it
        save_hf(loaded.model, loaded.tokenizer, d, {"source": loaded.source, "method": "dense"})
    return d


def phase_prune(work: Path, target: float, tokens: int) -> None:
    dense = dense_dir(work)
    recs = {}
    for name, flags in VARIANTS.items():
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


def phase_heal(work: Path, steps: int, batch: int, seq_len: int, lr: float) -> None:
    dense = dense_dir(work)
    t0 = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "compress",
            "heal",
            str(work / "best"),
            "--teacher",
            str(dense),
            "-o",
            str(work / "best-healed"),
            "--steps",
            str(steps),
            "--batch",
            str(batch),
            "--seq-len",
            str(seq_len),
            "--lr",
            str(lr),
            "--checkpoint-every",
            "25",
        ],
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(f"heal failed with exit {p.returncode}")
    res = json.loads((work / "best-healed.run" / "heal_result.json").read_text())
    _merge(
        {
            "heal": {
                "steps": steps,
                "batch": batch,
                "seq_len": seq_len,
                "lr": lr,
                "wall_s": round(time.monotonic() - t0, 1),
                "cpu_s": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1),
                "train_s": res["train_s"],
                "kl_first": res["losses"][0][1],
                "kl_last": res["losses"][-1][1],
                "loadavg_end": os.getloadavg(),
            }
        }
    )


def phase_eval(work: Path, tokens: int) -> None:
    dense = dense_dir(work)
    models = [
        str(work / n) for n in ("shortgpt", "wanda", "random", "best", "best-healed") if (work / n).is_dir()
    ]
    res = _cli("eval", *models, "--dense", str(dense), "--tokens", str(tokens), "-o", str(work / "eval"))
    _merge({"eval": res})


def phase_speed(work: Path, rounds: int) -> None:
    from gpufleet.compress.evaluate import llama_cpp_speed

    out = {}
    for name in ("dense", "best-healed"):
        src = work / name
        if not src.is_dir():
            continue
        out[name] = _cli("export", str(src), "-o", str(work / f"export-{name}"), "--formats", "q8_0")
    paths = {n: work / f"export-{n}" / "model-q8_0.gguf" for n in out}
    samples: dict[str, dict[str, list[float]]] = {n: {"prefill_tok_s": [], "decode_tok_s": []} for n in paths}
    loads = []
    for _ in range(rounds):  # alternate, so a load change on the shared host hits both alike
        for n, p in paths.items():
            s = llama_cpp_speed(p, repeats=1)
            for k, v in s.items():
                samples[n][k].append(v)
            loads.append(os.getloadavg()[0])
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    speed = {
        "rounds": rounds,
        "samples": samples,
        "median": med,
        "loadavg": loads,
        "gguf_bytes": {n: p.stat().st_size for n, p in paths.items()},
        "logit_check": {n: o["max_logit_diff"] for n, o in out.items()},
    }
    if "dense" in med and "best-healed" in med:
        speed["prefill_speedup"] = round(
            med["best-healed"]["prefill_tok_s"] / med["dense"]["prefill_tok_s"], 3
        )
        speed["decode_speedup"] = round(med["best-healed"]["decode_tok_s"] / med["dense"]["decode_tok_s"], 3)
    _merge({"speed": speed})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/p8"))
    ap.add_argument("--phase", default="all", choices=["prune", "heal", "eval", "speed", "all"])
    ap.add_argument("--target", type=float, default=0.75)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--heal-steps", type=int, default=100)
    ap.add_argument("--heal-batch", type=int, default=4)
    ap.add_argument("--heal-seq-len", type=int, default=256)
    ap.add_argument("--heal-lr", type=float, default=3e-4)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--speed-rounds", type=int, default=5)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.phase in ("prune", "all"):
        phase_prune(a.work, a.target, a.calib_tokens)
    if a.phase in ("heal", "all"):
        phase_heal(a.work, a.heal_steps, a.heal_batch, a.heal_seq_len, a.heal_lr)
    if a.phase in ("eval", "all"):
        phase_eval(a.work, a.eval_tokens)
    if a.phase in ("speed", "all"):
        phase_speed(a.work, a.speed_rounds)
    print(json.dumps(json.loads(RESULTS.read_text()), indent=1)[:4000])


if __name__ == "__main__":
    main()
