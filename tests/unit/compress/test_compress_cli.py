"""`gpufleet compress` on bad input: one line on stderr, exit 2, no traceback (real CLI processes,
tiny models on disk). And the whole prune -> eval -> export path on a tiny model through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.compress.export import save_hf
from gpufleet.compress.model import native_bf16
from support.cli import CliResult, gpufleet
from unit.compress.tinyllama import make_tiny, make_tokenizer, tiny_texts


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    tok = make_tokenizer()
    save_hf(make_tiny(len(tok)), tok, root / "dense")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(16):  # two of the texts the tokenizer was trained on: the domain uses part of it
        (corpus / f"f{i}.py").write_text(tiny_texts()[i % 2])
    empty = root / "empty"
    empty.mkdir()
    (empty / "a.bin").write_bytes(b"\xff\xfe\x00\x81" * 10)  # not UTF-8: no text
    return {"root": root, "dense": root / "dense", "corpus": corpus, "empty": empty}


def _run(*args: str) -> CliResult:
    return gpufleet("compress", *args)


def _one_line_exit_2(p: CliResult, needle: str) -> None:
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("gpufleet: error:")]
    assert len(lines) == 1 and needle in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("target", ["0", "1.5", "1", "-0.2"])
def test_target_outside_0_1(world, target):
    p = _run("prune", "--model", str(world["dense"]), "-o", str(world["root"] / "x"), "--target", target)
    _one_line_exit_2(p, "--target must be a fraction")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--min-layer-flops-cut", "1.5"], "--min-layer-flops-cut must be in [0, 1)"),
        (["--method", "wanda", "--min-layer-flops-cut", "0.2"], "needs a structured method"),
        (["--channel-score", "magnitude"], "--channel-score must be one of out, act"),
        (["--reconstruct-mode", "greedy"], "--reconstruct-mode must be one of sequential, dense"),
        (["--reconstruct-ridge", "-1"], "--reconstruct-ridge must be in [0, 1000)"),
        (["--reconstruct-ridge", "nan"], "--reconstruct-ridge must be in [0, 1000)"),
        (["--reconstruct-tokens", "0"], "--reconstruct-tokens must be positive"),
        (["--calib-per-file", "-1"], "--calib-per-file must be >= 0"),
    ],
)
def test_bad_compute_options(world, flags, needle):
    _one_line_exit_2(
        _run("prune", "--model", str(world["dense"]), "-o", str(world["root"] / "x"), *flags), needle
    )


@pytest.mark.parametrize("weight", ["1.5", "-0.1", "nan"])
def test_heal_ce_weight_outside_0_1(world, weight):
    p = _run("heal", str(world["dense"]), "-o", str(world["root"] / "h"), "--ce-weight", weight)
    _one_line_exit_2(p, "--ce-weight must be in [0, 1]")
    assert not (world["root"] / "h.run").exists()  # refused before any run directory or worker


def test_unsupported_architecture_hf_and_gguf(world, tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _one_line_exit_2(
        _run("prune", "--model", str(gpt2), "-o", str(tmp_path / "o")), "unsupported architecture 'gpt2'"
    )
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = _run("analyze", "--model", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "a"))
    _one_line_exit_2(p, "unsupported architecture 'gpt2'")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    _one_line_exit_2(_run("analyze", "--model", str(tmp_path / "junk.gguf")), "not a readable GGUF")


def test_empty_calibration_corpus(world):
    p = _run(
        "prune",
        "--model",
        str(world["dense"]),
        "-o",
        str(world["root"] / "x"),
        "--domain",
        str(world["empty"]),
    )
    _one_line_exit_2(p, "is empty")


def test_tokenizer_mismatch(world, tmp_path):
    """A vocabulary-trimmed model saved with the dense tokenizer: ids beyond its embedding."""
    from gpufleet.compress import prune

    tok = make_tokenizer()
    m = make_tiny(len(tok))
    prune.trim_vocab(m, tok, [40, 50, 60])
    save_hf(m, tok, tmp_path / "bad")
    p = _run("export", str(tmp_path / "bad"), "-o", str(tmp_path / "e"))
    _one_line_exit_2(p, "tokenizer mismatch")


def test_prune_eval_export_through_the_cli(world):
    root = world["root"]
    corpus = str(world["corpus"])
    p = _run(
        "prune",
        "--model",
        str(world["dense"]),
        "-o",
        str(root / "p"),
        "--method",
        "auto",
        "--vocab",
        "--domain",
        corpus,
        "--tokens",
        "1024",
        "--target",
        "0.7",
        "--min-layer-flops-cut",
        "0.2",
        "--reconstruct-tokens",  # the default 16,384 would add ~15 s on a loaded host
        "2048",
        # this corpus is two texts repeated: spread 256-token slices of it are the same two openings
        # over and over, on which the random tiny model's search picks a depth-only cut (no refit)
        "--calib-per-file",
        "0",
        "--bf16",
        "--json",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(p.stdout)
    assert rec["params"] <= 0.7 * rec["dense_params"] and rec["vocab"]["kept"] < rec["vocab"]["dense"]
    assert len(rec["candidates"]) >= 2 and rec["layer_flops_ratio"] <= 0.8
    rc = rec["reconstruct"]  # on by default: the refit lowered the projections' output error
    assert rc["mode"] == "sequential" and rc["tokens"] == 2048
    assert rc["down_proj_rel_err_mean"]["after"] < rc["down_proj_rel_err_mean"]["before"]
    assert rec["precision"] == "bf16"  # asked for; the default follows the CPU (eval below)
    p = _run(
        "eval",
        str(root / "p"),
        "--dense",
        str(world["dense"]),
        "--domain",
        corpus,
        "--general",
        corpus,
        "--tokens",
        "512",
        "-o",
        str(root / "ev"),
        "--json",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ev = json.loads(p.stdout)
    assert ev["precision"] == ("bf16" if native_bf16() else "fp32")
    rows = ev["rows"]
    assert rows[1]["params_ratio"] == pytest.approx(rec["ratio"], abs=1e-3)
    assert rows[0]["domain_ppl"] > 1 and rows[1]["domain_ppl"] > 1
    assert (root / "ev" / "eval.png").stat().st_size > 0
    p = _run("export", str(root / "p"), "-o", str(root / "ex"), "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert set(res["files"]) == {"hf", "f16", "q8_0"}
    assert res["max_logit_diff"]["f16"] < 0.05 and res["max_logit_diff"]["q8_0"] < 0.5
