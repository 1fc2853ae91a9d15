"""Prove exact recovery: compare the model weights in the newest checkpoints of two run directories.

The weights are read with plain ``torch.distributed.checkpoint.load`` (no process group, no model
code): the template is built from the checkpoint's own metadata, so any model works. The digest is
a sha256 over every tensor under the model prefix, in key order (key, dtype, shape, raw bytes).

    python -m gpufleet.demo.compare RUN_DIR_A RUN_DIR_B      # exit 0 if identical, 1 if not
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpufleet.core.exitcodes import ExitCode

__all__ = ["Comparison", "WeightsDigest", "compare_runs", "latest_checkpoint", "load_model_tensors", "main"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"


def _candidates(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    out = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def _verified(path: Path) -> bool:
    """Sizes and checksums against the manifest, through the checkpoint engine's verifier."""
    try:
        from gpufleet.checkpoint.verify import verify_dir
    except ImportError:  # the engine is optional for this tool: a manifest is then enough
        return True
    _, reason = verify_dir(path)
    return reason is None


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path]:
    """Newest committed checkpoint (a ``step_N`` dir with a manifest, verified when possible)."""
    run_dir = Path(run_dir)
    for step, path in _candidates(run_dir):
        if _verified(path):
            return step, path
    raise FileNotFoundError(f"no committed checkpoint under {run_dir}")


def load_model_tensors(ckpt_dir: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor whose flattened key starts with ``prefix``, keyed without the prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt_dir))
    meta = reader.read_metadata()
    template: dict[str, torch.Tensor] = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            template[key] = torch.empty(md.size, dtype=md.properties.dtype)
    if not template:
        raise ValueError(f"checkpoint {ckpt_dir} holds no tensors under {prefix!r}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    out = {}
    for key in sorted(template):
        name = key[len(prefix) :]
        out[name.removeprefix("module.")] = template[key]
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class WeightsDigest:
    run_dir: Path
    step: int
    path: Path
    sha256: str
    n_tensors: int
    n_params: int


@dataclass
class Comparison:
    a: WeightsDigest
    b: WeightsDigest
    identical: bool
    max_abs_diff: float
    mismatched: list[str]

    def to_dict(self) -> dict[str, object]:
        def d(w: WeightsDigest) -> dict[str, object]:
            return {
                "run_dir": str(w.run_dir),
                "step": w.step,
                "checkpoint": str(w.path),
                "sha256": w.sha256,
                "tensors": w.n_tensors,
                "params": w.n_params,
            }

        return {
            "identical": self.identical,
            "max_abs_diff": self.max_abs_diff,
            "mismatched": self.mismatched,
            "a": d(self.a),
            "b": d(self.b),
        }


def compare_runs(run_a: str | Path, run_b: str | Path, prefix: str = "model.") -> Comparison:
    """Load the newest checkpoint of each run and compare the model weights bit for bit."""
    loaded = []
    for rd in (Path(run_a), Path(run_b)):
        step, path = latest_checkpoint(rd)
        tensors = load_model_tensors(path, prefix)
        wd = WeightsDigest(
            rd, step, path, digest(tensors), len(tensors), sum(t.numel() for t in tensors.values())
        )
        loaded.append((wd, tensors))
    (wa, ta), (wb, tb) = loaded
    mismatched = sorted(set(ta) ^ set(tb))
    max_diff = 0.0
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            mismatched.append(name)
            max_diff = float("inf")
            continue
        if not torch.equal(x, y):
            mismatched.append(name)
            if x.numel():
                max_diff = max(max_diff, float((x.double() - y.double()).abs().max()))
    identical = wa.sha256 == wb.sha256 and not mismatched
    return Comparison(wa, wb, identical, max_diff, mismatched)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpufleet.demo.compare", description=__doc__.splitlines()[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--prefix", default="model.", help="flattened key prefix of the model (default model.)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        c = compare_runs(args.run_a, args.run_b, args.prefix)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    if args.json:
        print(json.dumps(c.to_dict(), indent=2))
    else:
        for w in (c.a, c.b):
            print(f"{w.run_dir}: step {w.step}, {w.n_params:,} params, sha256 {w.sha256}")
        verdict = "IDENTICAL" if c.identical else "DIFFERENT"
        print(f"{verdict} (max abs diff {c.max_abs_diff:.3g}, {len(c.mismatched)} tensors differ)")
    return 0 if c.identical else 1


if __name__ == "__main__":
    sys.exit(main())
