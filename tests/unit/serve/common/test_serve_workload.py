"""Workload specs, presets, prefixes and Mooncake traces (including fuzzed bad lines)."""

from __future__ import annotations

import json
import random

import pytest

from gpufleet.core.errors import UsageError
from gpufleet.serve.common.workload import BLOCK_TOKENS, load_mooncake, load_workload, parse_dist, parse_spec


def test_dists_parse_and_sample():
    rng = random.Random(0)
    assert parse_dist("fixed:128").sample(rng) == 128
    assert parse_dist("64").sample(rng) == 64
    u = parse_dist("uniform:10-20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    ln = parse_dist("lognormal:512,0.5")
    xs = sorted(ln.sample(rng) for _ in range(4000))
    assert 450 < xs[len(xs) // 2] < 580  # median ≈ 512


@pytest.mark.parametrize(
    "bad",
    [
        "fixed:0",
        "fixed:-3",
        "fixed:x",
        "uniform:9-3",
        "uniform:5",
        "lognormal:512",
        "lognormal:512,99",
        "zipf:3",
        "",
        "fixed:1e99",
    ],
)
def test_bad_dists(bad):
    with pytest.raises(UsageError):
        parse_dist(bad)


def test_spec_keys_presets_and_overrides():
    w = parse_spec("in=lognormal:512,0.5;out=fixed:128")
    assert str(w.input) == "lognormal:512,0.5" and str(w.output) == "fixed:128"
    r = parse_spec("reasoning;out=fixed:1000")
    assert str(r.output) == "fixed:1000" and str(r.input).startswith("lognormal")
    assert parse_spec("reasoning").output.mean() > 2000
    for bad in ["", "bogus", "in=fixed:5;colour=red", "prefix=3", "prefix=a:3", "in=fixed:0"]:
        with pytest.raises(UsageError):
            parse_spec(bad)


def test_requests_are_deterministic_and_unique():
    w = parse_spec("in=fixed:50;out=fixed:7", seed=3)
    a, b = w.request(5), parse_spec("in=fixed:50;out=fixed:7", seed=3).request(5)
    assert a == b and a.output_tokens == 7 and len(a.prompt.split()) == 50
    assert w.request(5).prompt != w.request(6).prompt


def test_shared_prefixes():
    w = parse_spec("in=fixed:20;out=fixed:4;prefix=3:100", seed=1)
    prompts = [w.request(i).prompt for i in range(60)]
    prefixes = {" ".join(p.split()[:100]) for p in prompts}
    assert len(prefixes) == 3
    assert all(w.request(i).input_tokens == 120 for i in range(5))


def _trace(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_mooncake_blocks_share_text(tmp_path):
    p = _trace(
        tmp_path,
        [
            json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}),
            json.dumps({"timestamp": 250, "input_length": 700, "output_length": 9, "hash_ids": [1, 3]}),
            "",
            json.dumps({"timestamp": 100, "input_length": 10, "output_length": 1}),
        ],
    )
    w = load_workload(str(p))
    assert [e.timestamp_ms for e in w.entries] == [0, 100, 250]  # sorted
    r0, r2 = w.request(0), w.request(2)
    assert r2.offset_s == pytest.approx(0.25) and r2.output_tokens == 9
    w0, w2 = r0.prompt.split(), r2.prompt.split()
    assert len(w0) == 1000 and len(w2) == 700
    assert w0[:BLOCK_TOKENS] == w2[:BLOCK_TOKENS]  # hash id 1 → same block
    assert w0[BLOCK_TOKENS:700] != w2[BLOCK_TOKENS:700]


@pytest.mark.parametrize(
    "line,msg",
    [
        ("not json", "not valid JSON"),
        ("[1,2]", "JSON object"),
        ('{"timestamp": 0, "input_length": 5}', "missing output_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
    ],
)
def test_mooncake_bad_lines_are_one_line_errors(tmp_path, line, msg):
    p = _trace(tmp_path, ['{"timestamp": 0, "input_length": 5, "output_length": 1}', line])
    with pytest.raises(UsageError, match=msg) as e:
        load_mooncake(p)
    assert "line 2" in str(e.value) and "\n" not in str(e.value)


def test_mooncake_missing_empty_and_binary(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_workload(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UsageError, match="no requests"):
        load_mooncake(_trace(tmp_path, ["", "  "]))
    b = tmp_path / "b.jsonl"
    b.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError):
        load_mooncake(b)


def test_mooncake_fuzz_never_raises_anything_but_usage_error(tmp_path):
    rng = random.Random(1234)
    good = json.dumps({"timestamp": 12, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]})
    alphabet = list('{}[]":,0123456789-.eE tnrualsfx\\') + ["\n"]
    for i in range(300):
        s = list(good)
        for _ in range(rng.randint(1, 6)):
            op, pos = rng.random(), rng.randrange(len(s) + 1)
            if op < 0.4 and s:
                del s[min(pos, len(s) - 1)]
            elif op < 0.8:
                s.insert(pos, rng.choice(alphabet))
            else:
                s = s[:pos]
        p = tmp_path / f"f{i}.jsonl"
        p.write_text("".join(s))
        try:
            w = load_mooncake(p)
        except UsageError as e:
            assert "\n" not in str(e)
        else:
            w.request(0)  # whatever parsed must build a prompt
