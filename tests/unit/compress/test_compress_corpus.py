"""The healing pool spans the corpus: ``corpus.tokens(..., per_file=k)`` takes at most k tokens of
each file per pass, every file once before any file again, in a fixed order, until it has enough
(or every file is read to its end); ``per_file=0`` is the files in sorted order, whole."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from gpufleet.compress import corpus
from unit.compress.tinyllama import make_tokenizer

MODULES = [
    "textwrap.py", "fnmatch.py", "shlex.py", "bisect.py", "glob.py", "heapq.py",
    "keyword.py", "colorsys.py", "copy.py", "struct.py", "stat.py", "numbers.py",
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok = make_tokenizer()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, name in enumerate(MODULES):  # twelve different texts of different lengths
        (root / name).write_text((stdlib / name).read_text()[: 400 + 300 * i])
    whole = {
        rel: tok(corpus._read(p), add_special_tokens=False)["input_ids"] for rel, p in corpus.files(str(root))
    }
    return str(root), tok, whole


def _segments(ids: list[int], eos: int) -> list[list[int]]:
    out, cur = [], []
    for t in ids:
        if t == eos:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out + ([cur] if cur else [])


def test_sorted_whole_files_by_default(setup):
    spec, tok, whole = setup
    ids = corpus.tokens(tok, spec, "all", 10**6)
    assert _segments(ids, tok.eos_token_id) == [whole[r] for r in sorted(whole)]  # all of it, in order


def test_a_spread_pool_visits_every_file_before_any_again(setup):
    spec, tok, whole = setup
    k = 40
    first_pass = sum(min(k, len(v)) + 1 for v in whole.values())
    ids = corpus.tokens(tok, spec, "all", first_pass + 3 * (k + 1), per_file=k)
    assert ids == corpus.tokens(tok, spec, "all", len(ids), per_file=k)  # deterministic
    segs = _segments(ids, tok.eos_token_id)
    owner = []  # which file each segment came from, and where in it
    offsets = dict.fromkeys(whole, 0)
    for seg in segs:
        (rel,) = [r for r in whole if whole[r][offsets[r] : offsets[r] + len(seg)] == seg and len(seg) <= k]
        owner.append(rel)
        offsets[rel] += len(seg)
    assert len(set(owner[: len(whole)])) == len(whole)  # pass one: every file once
    assert owner[len(whole) :] == owner[: len(owner) - len(whole)]  # pass two: the same order again
    assert owner[: len(whole)] != sorted(whole)  # mixed, not alphabetical


def test_a_spread_pool_stops_at_the_end_of_the_corpus(setup):
    spec, tok, whole = setup
    ids = corpus.tokens(tok, spec, "all", 10**6, per_file=100)
    assert len(ids) == sum(len(v) for v in whole.values()) + sum((len(v) + 99) // 100 for v in whole.values())
    assert sorted(t for t in ids if t != tok.eos_token_id) == sorted(t for v in whole.values() for t in v)


def test_a_shorter_spread_text_is_a_prefix_of_a_longer_one(setup):
    """What ``compress prune`` relies on to trim the vocabulary: its calibration text (N tokens)
    is a prefix of the scanned text (M >= N tokens, same ``per_file``), so every calibration token
    is kept."""
    spec, tok, _ = setup
    longer = corpus.tokens(tok, spec, "all", 3000, per_file=64)
    for n in (1, 65, 700, 2999):
        assert corpus.tokens(tok, spec, "all", n, per_file=64) == longer[:n]
