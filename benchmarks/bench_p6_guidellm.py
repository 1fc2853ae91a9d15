"""P6 side by side: the request rate one gpufleet client process sustains against the null endpoint,
and the rate GuideLLM sustains against the same null endpoint, in one run.

Sustained = p99 send lag <= --lag-ms (2 ms), achieved send rate >= 95% of scheduled, no failed
request, over one level of --duration seconds at a constant rate. Both tools are searched the same
way (gpufleet.serve.bench.findmax.search_max_rate: doubling, bisection, stability re-run).

* gpufleet: gpufleet.serve.bench.calibrate.max_sustainable_rate, one client process.
* GuideLLM: `guidellm run --profile kind=constant,rate=R` with synthetic 8-token prompts and
  2-token outputs, its default worker processes (10: more than our one, so the comparison
  favours GuideLLM). Its send lag per request = request_start - targeted_start from its JSON
  report (the time it meant to send vs the time it started the HTTP request).
  GuideLLM needs a tokenizer for synthetic prompts and the hub is unreachable: a word-level
  tokenizer is built locally (`tokenizers`) and passed by path.

GuideLLM lives in its own venv so our dependencies stay as they are:

    python3 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm
    .venv/bin/python benchmarks/bench_p6_guidellm.py [--guidellm /tmp/guidellm-venv/bin/guidellm]

Writes benchmarks/results/p6_guidellm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpufleet.serve.bench.calibrate import max_sustainable_rate  # noqa: E402
from gpufleet.serve.bench.findmax import Level, search_max_rate  # noqa: E402
from gpufleet.serve.bench.null_endpoint import start_null_endpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

_TOKENIZER_SCRIPT = """
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = "the of and to in is was that for on with as by at from this be or are an not have which".split()
vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
fast.save_pretrained(sys.argv[1])
"""


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


class GuideLLM:
    def __init__(self, exe: str, url: str, work: Path, duration_s: float) -> None:
        self.exe, self.url, self.work, self.duration_s = exe, url, work, duration_s
        self.tok = work / "tokenizer"
        py = str(Path(exe).parent / "python")
        subprocess.run([py, "-c", _TOKENIZER_SCRIPT, str(self.tok)], check=True, capture_output=True)
        self.levels: list[dict[str, Any]] = []

    def run(self, rate: float) -> dict[str, Any]:
        out = self.work / f"g-{rate:g}.json"
        cmd = [self.exe, "run", "--backend", f"kind=openai_http,target={self.url},model=null-model",
               "--profile", f"kind=constant,rate={rate:g}",
               "--constraint", f"kind=max_duration,seconds={self.duration_s:g}",
               "--data", "kind=synthetic_text,prompt_tokens=8,output_tokens=2",
               "--tokenizer", f"kind=huggingface_auto,model={self.tok}",
               "--output", f"kind=json,path={out}", "--disable-console"]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        wall = time.monotonic() - t0
        if r.returncode != 0 or not out.is_file():
            raise RuntimeError(f"guidellm failed ({r.returncode}): {r.stderr[-1500:] or r.stdout[-1500:]}")
        bench = json.loads(out.read_text())["benchmarks"][0]
        out.unlink()
        reqs = bench["requests"]
        ok = reqs["successful"]
        timings = [q["info"]["timings"] for q in ok]
        lags = [(t["request_start"] - t["targeted_start"]) * 1e3 for t in timings]
        made = bench["scheduler_metrics"]["requests_made"]
        sent = (made.get("successful") or len(ok)) + (made.get("errored") or 0)
        duration = bench["duration"] or self.duration_s
        level = {
            "rate": rate,
            "send_lag_p50_ms": _p(lags, 0.5),
            "send_lag_p99_ms": _p(lags, 0.99),
            "achieved_send_rate": sent / duration,
            "completed": len(ok),
            "errored": made.get("errored") or len(reqs["errored"]),
            "incomplete_at_end": made.get("incomplete"),
            "wall_s": wall,
        }
        self.levels.append(level)
        return level


def search_guidellm(g: GuideLLM, lag_ms: float, start: float) -> dict[str, Any]:
    first = len(g.levels)

    def measure(rate: float) -> Level:
        lv = g.run(rate)
        ok = (lv["send_lag_p99_ms"] <= lag_ms and lv["achieved_send_rate"] >= 0.95 * rate
              and lv["errored"] == 0)  # fmt: skip
        verdict = "sustained" if ok else "not sustained"
        print(f"  guidellm @ {rate:g}/s: lag p50 {lv['send_lag_p50_ms']:.2f} p99 {lv['send_lag_p99_ms']:.2f}"
              f" ms, sent {lv['achieved_send_rate']:.0f}/s -> {verdict}", flush=True)  # fmt: skip
        return Level(rate, 1.0 if ok else 0.0)

    s = search_max_rate(measure, 1.0, start, rel_tol=0.1, max_levels=9, min_rate=1.0)
    return {"max_rate": s.max_rate, "limited_by": s.limited_by, "stable": s.stable,
            "lowest_rate_tried": min(lv.rate for lv in s.levels), "levels": g.levels[first:]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guidellm", default="/tmp/guidellm-venv/bin/guidellm")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--lag-ms", type=float, default=2.0, help="P6's criterion: p99 send lag")
    ap.add_argument(
        "--relaxed-lag-ms",
        type=float,
        default=10.0,
        help="a second, looser criterion, where GuideLLM's fixed dispatch delay fits",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "p6_guidellm.json")
    a = ap.parse_args()
    result: dict[str, Any] = {
        "benchmark": "p6_guidellm",
        "criterion": "p99 send lag <= LAG ms, achieved >= 95% of scheduled, no failures; constant arrivals",
        "duration_s": a.duration, "measured_unix": time.time(),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "load1": os.getloadavg()[0]},
        "criteria": {},
    }  # fmt: skip
    if not Path(a.guidellm).is_file():
        sys.exit(f"{a.guidellm} not found: python3 -m venv /tmp/guidellm-venv && "
                 "/tmp/guidellm-venv/bin/pip install guidellm")  # fmt: skip
    version = subprocess.run([a.guidellm, "--version"], capture_output=True, text=True).stdout.strip()
    result["guidellm_version"] = version
    with start_null_endpoint() as ne, tempfile.TemporaryDirectory() as tmp:
        g = GuideLLM(a.guidellm, ne.url.removesuffix("/v1"), Path(tmp), a.duration)
        for lag in (a.lag_ms, a.relaxed_lag_ms):
            ours = max_sustainable_rate(ne.url, 1, lag, duration_s=a.duration, arrival="constant")
            print(f"[p99 lag <= {lag:g} ms] gpufleet (1 process): {ours['max_rate']:.0f} req/s", flush=True)
            theirs = search_guidellm(g, lag, 50.0)
            row: dict[str, Any] = {"gpufleet": ours, "guidellm": theirs}
            print(f"[p99 lag <= {lag:g} ms] {version}: {theirs['max_rate']:g} req/s ({theirs['limited_by']})")
            if theirs["max_rate"] > 0:
                row["ratio"] = ours["max_rate"] / theirs["max_rate"]
                print(f"[p99 lag <= {lag:g} ms] ratio gpufleet / GuideLLM: {row['ratio']:.1f}x")
            else:
                row["ratio_at_least"] = ours["max_rate"] / theirs["lowest_rate_tried"]
                low = theirs["lowest_rate_tried"]
                print(f"[p99 lag <= {lag:g} ms] GuideLLM sustained no rate down to {low:g} req/s:"
                      f" ratio > {row['ratio_at_least']:.0f}x")  # fmt: skip
            result["criteria"][f"{lag:g}ms"] = row
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
