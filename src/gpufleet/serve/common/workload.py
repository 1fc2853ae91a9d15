"""Workloads: what each request asks for (prompt, input and output length), generated locally.

Two sources, both picklable and deterministic per request index so that worker processes build
their own prompts:

* a synthetic spec, ``in=lognormal:512,0.5;out=fixed:128;prefix=8:256`` or a preset name
  (``chat``, ``reasoning``, ``short``), items separated by ``;`` (later items override earlier ones);
* a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``),
  whose 512-token blocks become text blocks: equal hash ids give equal text.

Lengths are in tokens of the *target*; prompts are built from a vocabulary of common English words
that are one token each in the usual BPE tokenizers, so one word is about one token.
See docs/serve-bench.md for the grammar.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpufleet.core.errors import UsageError

__all__ = [
    "LengthDist",
    "RequestSpec",
    "SyntheticWorkload",
    "TraceEntry",
    "TraceWorkload",
    "Workload",
    "PRESETS",
    "BLOCK_TOKENS",
    "parse_dist",
    "parse_spec",
    "load_mooncake",
    "load_workload",
]

BLOCK_TOKENS = 512  # Mooncake's hash_ids cover 512-token blocks
MAX_LEN = 1_000_000

PRESETS: dict[str, str] = {
    "chat": "in=lognormal:512,0.6;out=lognormal:192,0.6",
    "reasoning": "in=lognormal:256,0.5;out=lognormal:4096,0.4",  # long-output "thinking" traffic
    "short": "in=fixed:32;out=fixed:16",
}

_WORDS = (
    "the of and to in is was that for on with as by at from this be or are an not have which one "
    "all their more has been were there its can when who will out them about up into than other some "
    "time could these two may first then only new over way most after work also any where many well "
    "year city world state part water small long house great line system place group number people "
    "day each right left point high end hand case week fact company area book word home road life "
    "game light power music money market story table river field paper model order force party"
).split()


DistKind = Literal["fixed", "uniform", "lognormal"]


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed:N``, ``uniform:A-B`` or ``lognormal:MEDIAN,SIGMA``."""

    kind: DistKind
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            v = self.a
        elif self.kind == "uniform":
            v = rng.randint(int(self.a), int(self.b))
        else:  # lognormal: a = median = exp(mu), b = sigma
            v = rng.lognormvariate(math.log(self.a), self.b)
        return max(1, min(MAX_LEN, round(v)))

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b**2 / 2)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}-{int(self.b)}"
        return f"lognormal:{self.a:g},{self.b:g}"


def _num(text: str, what: str, integer: bool = True) -> float:
    try:
        v = int(text) if integer else float(text)
    except ValueError:
        raise UsageError(f"{what}: {text!r} is not a{'n integer' if integer else ' number'}") from None
    if not math.isfinite(v) or v <= 0 or v > MAX_LEN:
        raise UsageError(f"{what}: {text!r} must be > 0 and <= {MAX_LEN}")
    return v


def parse_dist(text: str, what: str = "length") -> LengthDist:
    """Parse ``fixed:N`` (or a bare ``N``), ``uniform:A-B`` or ``lognormal:MEDIAN,SIGMA``."""
    kind, _, arg = text.strip().partition(":")
    kind = kind.strip().lower()
    if not arg and kind.isdigit():
        return LengthDist("fixed", _num(kind, what))
    if kind == "fixed":
        return LengthDist("fixed", _num(arg, what))
    if kind == "uniform":
        lo, sep, hi = arg.partition("-")
        if not sep:
            raise UsageError(f"{what}: uniform needs A-B, got {text!r}")
        a, b = _num(lo, what), _num(hi, what)
        if b < a:
            raise UsageError(f"{what}: uniform:{arg} has A > B")
        return LengthDist("uniform", a, b)
    if kind == "lognormal":
        med, sep, sig = arg.partition(",")
        if not sep:
            raise UsageError(f"{what}: lognormal needs MEDIAN,SIGMA, got {text!r}")
        sigma = _num(sig, what, integer=False)
        if sigma > 5:
            raise UsageError(f"{what}: lognormal sigma {sigma:g} is too large (max 5)")
        return LengthDist("lognormal", _num(med, what, integer=False), sigma)
    raise UsageError(f"{what}: unknown distribution {text!r} (choose fixed:N, uniform:A-B, lognormal:M,S)")


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, the lengths asked for, and the trace offset (seconds) if any."""

    index: int
    prompt: str
    input_tokens: int
    output_tokens: int
    offset_s: float | None = None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(_WORDS, k=n))


@dataclass(frozen=True)
class SyntheticWorkload:
    """Lengths from distributions; ``prefixes`` distinct shared prefixes of ``prefix_len`` tokens."""

    input: LengthDist
    output: LengthDist
    prefixes: int = 0
    prefix_len: int = 0
    seed: int = 0
    spec: str = ""

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(self.seed * 1_000_003 + index)
        n_in, n_out = self.input.sample(rng), self.output.sample(rng)
        prompt = f"{index} " + _words(rng, max(0, n_in - 1))  # unique start: no accidental cache hits
        total = n_in
        if self.prefixes:
            p = rng.randrange(self.prefixes)
            prefix = _words(random.Random(f"prefix-{self.seed}-{p}"), self.prefix_len)
            prompt = prefix + " " + prompt
            total += self.prefix_len
        return RequestSpec(index, prompt, total, n_out)

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {
            "kind": "synthetic",
            "spec": self.spec,
            "input": str(self.input),
            "output": str(self.output),
        }
        if self.prefixes:
            d["prefix"] = {"count": self.prefixes, "tokens": self.prefix_len}
        return d


def parse_spec(text: str, seed: int = 0) -> SyntheticWorkload:
    """Parse a workload spec (see module doc); raises :class:`UsageError` naming the bad item."""
    fields: dict[str, str] = {}
    items = [s.strip() for s in text.split(";") if s.strip()]
    if not items:
        raise UsageError("empty workload spec (try 'chat' or 'in=fixed:128;out=fixed:64')")
    for item in items:
        if "=" not in item:
            if item.lower() not in PRESETS:
                raise UsageError(
                    f"workload: unknown preset {item!r} (presets: {', '.join(PRESETS)}; "
                    "or key=value items in=, out=, prefix=)"
                )
            for sub in PRESETS[item.lower()].split(";"):
                k, _, v = sub.partition("=")
                fields[k] = v
            continue
        k, _, v = item.partition("=")
        k = k.strip().lower()
        if k not in ("in", "out", "prefix"):
            raise UsageError(f"workload: unknown key {k!r} in {item!r} (keys: in, out, prefix)")
        fields[k] = v.strip()
    inp = parse_dist(fields.get("in", "fixed:128"), "workload in=")
    out = parse_dist(fields.get("out", "fixed:64"), "workload out=")
    prefixes = prefix_len = 0
    if "prefix" in fields:
        n, sep, ln = fields["prefix"].partition(":")
        if not sep:
            raise UsageError(f"workload prefix= needs COUNT:TOKENS, got {fields['prefix']!r}")
        prefixes, prefix_len = int(_num(n, "workload prefix count")), int(_num(ln, "workload prefix len"))
    return SyntheticWorkload(inp, out, prefixes, prefix_len, seed, text)


@dataclass(frozen=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _block(hash_id: int, n: int) -> str:
    return _words(random.Random(f"block-{hash_id}"), n)


@dataclass(frozen=True)
class TraceWorkload:
    """A Mooncake trace; request ``i`` is line ``i`` (sorted by timestamp), offset from the first."""

    entries: tuple[TraceEntry, ...]
    path: str = ""

    def request(self, index: int) -> RequestSpec:
        e = self.entries[index % len(self.entries)]
        parts: list[str] = []
        left = e.input_length
        for h in e.hash_ids:
            if left <= 0:
                break
            n = min(BLOCK_TOKENS, left)
            parts.append(_block(h, n))
            left -= n
        if left > 0:  # fewer hash ids than the length needs: unique filler
            parts.append(
                f"{index} " + _words(random.Random(f"fill-{index}"), left - 1) if left > 1 else str(index)
            )
        offset = (e.timestamp_ms - self.entries[0].timestamp_ms) / 1000.0
        return RequestSpec(index, " ".join(parts), e.input_length, e.output_length, offset)

    def describe(self) -> dict[str, object]:
        return {
            "kind": "mooncake_trace",
            "path": self.path,
            "requests": len(self.entries),
            "span_s": (self.entries[-1].timestamp_ms - self.entries[0].timestamp_ms) / 1000.0,
        }


Workload = SyntheticWorkload | TraceWorkload


def _entry(obj: object, where: str) -> TraceEntry:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
    if missing:
        raise UsageError(f"{where}: missing {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise UsageError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    lens = []
    for k in ("input_length", "output_length"):
        v = obj[k]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_LEN:
            raise UsageError(f"{where}: {k} must be an integer in 1..{MAX_LEN}, got {v!r}")
        lens.append(v)
    hids = obj.get("hash_ids", [])
    if not isinstance(hids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hids):
        raise UsageError(f"{where}: hash_ids must be a list of integers")
    return TraceEntry(float(ts), lens[0], lens[1], tuple(hids))


def load_mooncake(path: Path) -> TraceWorkload:
    """Read a Mooncake JSONL trace; any bad line is a one-line :class:`UsageError` with its number."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"trace {path} is not UTF-8 text") from None
    entries: list[TraceEntry] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"trace {path.name} line {n}"
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise UsageError(f"{where}: not valid JSON") from None
        entries.append(_entry(obj, where))
    if not entries:
        raise UsageError(f"trace {path} holds no requests")
    entries.sort(key=lambda e: e.timestamp_ms)
    return TraceWorkload(tuple(entries), str(path))


def load_workload(text: str, seed: int = 0) -> Workload:
    """A ``.jsonl`` path (or any existing file) is a Mooncake trace; anything else is a spec."""
    p = Path(text)
    if text.endswith((".jsonl", ".json")) or ("=" not in text and p.is_file()):
        if not p.is_file():
            raise UsageError(f"trace file not found: {text}")
        return load_mooncake(p)
    return parse_spec(text, seed)
