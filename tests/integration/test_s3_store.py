"""S3Store against a real SeaweedFS server, directly and through the flaky proxy (a real process)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gpufleet.core.errors import RetryableStorageError, TerminalStorageError

pytest.importorskip("boto3")

from gpufleet.checkpoint.storage.s3 import S3Store  # noqa: E402
from support.flaky_proxy import FlakyProxy  # noqa: E402

pytestmark = pytest.mark.s3
MiB = 1024 * 1024
FAST = {"backoff_base": 0.01, "backoff_cap": 0.2}  # keep retry sleeps short in tests
SMALL_PARTS = {"multipart_threshold": 5 * MiB, "multipart_chunksize": 5 * MiB}  # S3's minimum part


def make_checkpoint(root: Path, big_mib: int = 12, seed: int = 0) -> dict[str, bytes]:
    """A checkpoint-shaped directory: a multi-MB shard (multipart), small files, a manifest."""
    files = {
        "__0_0.distcp": os.urandom(big_mib * MiB),
        "__1_0.distcp": os.urandom(300_000),
        ".metadata": b"meta" * 100,
        "extra/rng.bin": bytes(range(256)) * 4,
        "manifest.json": json.dumps({"step": 100, "seed": seed}).encode(),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def key_of(entry: dict) -> str:
    return entry["path"].split("?")[0]


def test_round_trip_multipart_list_read_delete(s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_checkpoint(src)
    store = S3Store(s3_url, **SMALL_PARTS, **FAST)
    assert "secret" not in repr(store).lower() and os.environ["AWS_SECRET_ACCESS_KEY"] not in repr(store)

    sent = store.upload_dir(src, "step_00000100")
    assert sent == sum(len(v) for v in files.values())
    # A second checkpoint without a manifest (an interrupted upload) must stay invisible.
    half = tmp_path / "half"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"x" * 10)
    store.upload_dir(half, "step_00000200")
    assert store.list_prefixes() == ["step_00000100"]
    assert store.read_json("step_00000100/manifest.json") == {"step": 100, "seed": 0}

    dst = tmp_path / "dst"
    got = store.download_dir("step_00000100", dst)
    assert got == sent
    assert read_tree(dst) == files

    store.delete_prefix("step_00000100")
    store.delete_prefix("step_00000200")
    assert store.list_prefixes() == []
    with pytest.raises(TerminalStorageError):
        store.download_dir("step_00000100", tmp_path / "gone")


def test_manifest_written_last_and_deleted_first(s3_server, s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_checkpoint(src, big_mib=11)
    with FlakyProxy(s3_server.endpoint, error_rate=0.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint, **SMALL_PARTS, **FAST)
        store.upload_dir(src, "step_1")
        upload_log = proxy.request_log()
        store.download_dir("step_1", tmp_path / "dst")
        download_log = proxy.request_log()[len(upload_log) :]
        store.delete_prefix("step_1")
        delete_log = proxy.request_log()[len(upload_log) + len(download_log) :]

    writes = [e for e in upload_log if e["method"] in ("PUT", "POST")]
    manifest_puts = [e for e in writes if key_of(e).endswith("/step_1/manifest.json")]
    others = [e for e in writes if e not in manifest_puts]
    assert len(manifest_puts) == 1 and len(others) >= 4 + 3  # small files + 3 parts (+ create/complete)
    assert manifest_puts[0]["start"] >= max(e["end"] for e in others)

    gets = [e for e in download_log if e["method"] == "GET" and "list-type" not in e["path"]]
    manifest_gets = [e for e in gets if key_of(e).endswith("/manifest.json")]
    assert len(manifest_gets) == 1
    assert manifest_gets[0]["start"] >= max(e["end"] for e in gets if e not in manifest_gets)

    deletes = [e for e in delete_log if e["method"] in ("DELETE", "POST")]
    assert deletes[0]["method"] == "DELETE" and key_of(deletes[0]).endswith("/step_1/manifest.json")
    assert any(e["method"] == "POST" and "delete" in e["path"] for e in deletes[1:])


def test_flaky_server_upload_and_download_still_succeed(s3_server, s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_checkpoint(src, big_mib=16)
    with FlakyProxy(s3_server.endpoint, error_rate=0.25, seed=1) as proxy:
        store = S3Store(s3_url, proxy.endpoint, max_attempts=10, **SMALL_PARTS, **FAST)
        store.upload_dir(src, "step_00000007")
        assert store.list_prefixes() == ["step_00000007"]
        assert store.read_json("step_00000007/manifest.json")["step"] == 100
        store.download_dir("step_00000007", tmp_path / "dst")
        store.delete_prefix("step_00000007")
        assert store.list_prefixes() == []
        stats = proxy.stats()
    assert read_tree(tmp_path / "dst") == files
    assert stats["injected"] > 0 and stats["injected_503"] > 0 and stats["injected_500"] > 0
    assert 0.1 < stats["injected"] / stats["requests"] < 0.45


def test_retries_exhausted_is_retryable(s3_server, s3_url: str, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    with FlakyProxy(s3_server.endpoint, error_rate=1.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint, max_attempts=3, botocore_max_attempts=1, **FAST)
        with pytest.raises(RetryableStorageError, match="SlowDown|InternalError"):
            store.upload_dir(tmp_path, "step_1")
        assert proxy.stats()["requests"] == 3


def test_wrong_secret_is_terminal_without_retry_storm(
    s3_server, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    (tmp_path / "manifest.json").write_text("{}")
    with FlakyProxy(s3_server.endpoint, error_rate=0.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint)  # default, slow backoff: a retry would show in time
        t0 = time.monotonic()
        with pytest.raises(TerminalStorageError, match="403"):
            store.list_prefixes()
        with pytest.raises(TerminalStorageError):
            store.upload_dir(tmp_path, "step_1")
        elapsed = time.monotonic() - t0
        requests = proxy.stats()["requests"]
    assert elapsed < 3.0
    assert requests <= 2  # one list, one PUT: nothing retried
    assert "not-the-secret" not in repr(store)


def test_missing_bucket_and_key_are_terminal(s3_server, s3_url: str, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    missing = S3Store("s3://no-such-bucket-gpufleet/x")
    t0 = time.monotonic()
    with pytest.raises(TerminalStorageError, match="NoSuchBucket|404"):
        missing.upload_dir(tmp_path, "step_1")
    with pytest.raises(TerminalStorageError):
        missing.list_prefixes()
    with pytest.raises(TerminalStorageError, match="NoSuchKey|404"):
        S3Store(s3_url).read_json("step_9/manifest.json")
    assert time.monotonic() - t0 < 3.0


# ----------------------------------------------------------------------------- parallel ranged GETs
PART = 1 * MiB
RANGED = {"multipart_threshold": 64 * MiB, "range_size": PART}  # single PUTs, 1 MiB GET ranges


def sized_checkpoint(root: Path) -> dict[str, bytes]:
    """Files sized around the range boundaries: empty, 1 byte, one part -1/0/+1, several parts."""
    files = {
        "empty.bin": b"",
        "one.bin": b"x",
        "below.bin": os.urandom(PART - 1),
        "exact.bin": os.urandom(PART),
        "above.bin": os.urandom(PART + 1),
        "many.bin": os.urandom(5 * PART + 7),
        "sub/dir/deep.bin": os.urandom(2 * PART),
        "manifest.json": b'{"step": 3}',
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def range_gets(log: list[dict]) -> dict[str, list[str]]:
    """Object name -> the Range headers of its GETs (listings left out), in request order."""
    out: dict[str, list[str]] = {}
    for e in log:
        if e["method"] == "GET" and "list-type" not in e["path"]:
            out.setdefault(key_of(e).split("/step_3/", 1)[1], []).append(e["range"])
    return out


def test_ranges_split_at_part_boundaries_and_bytes_are_identical(
    s3_server, s3_url: str, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    files = sized_checkpoint(src)
    with FlakyProxy(s3_server.endpoint, error_rate=0.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint, **RANGED, **FAST)
        store.upload_dir(src, "step_3")
        before = len(proxy.request_log())
        dst = tmp_path / "dst"
        (dst / "many.bin").parent.mkdir(parents=True)
        (dst / "many.bin").write_bytes(b"stale" * PART)  # a longer leftover file is truncated, not kept
        assert store.download_dir("step_3", dst) == sum(len(v) for v in files.values())
        gets = range_gets(proxy.request_log()[before:])
    assert read_tree(dst) == files
    assert "empty.bin" not in gets  # a zero-byte object needs no GET: the empty file is the download
    assert gets["one.bin"] == ["bytes=0-0"]
    assert gets["below.bin"] == [f"bytes=0-{PART - 2}"]
    assert gets["exact.bin"] == [f"bytes=0-{PART - 1}"]
    assert sorted(gets["above.bin"]) == sorted([f"bytes=0-{PART - 1}", f"bytes={PART}-{PART}"])
    want = [f"bytes={a}-{min(a + PART, 5 * PART + 7) - 1}" for a in range(0, 5 * PART + 7, PART)]
    assert sorted(gets["many.bin"]) == sorted(want)
    assert len(gets["sub/dir/deep.bin"]) == 2


def test_a_range_cut_mid_body_resumes_at_the_first_missing_byte(
    s3_server, s3_url: str, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    files = {"big.bin": os.urandom(8 * 4 * MiB), "manifest.json": b"{}"}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    S3Store(s3_url, **FAST).upload_dir(src, "step_3")
    with FlakyProxy(s3_server.endpoint, error_rate=0.0, cut_rate=0.4, seed=3) as proxy:
        store = S3Store(s3_url, proxy.endpoint, range_size=4 * MiB, max_attempts=10, **FAST)
        store.download_dir("step_3", tmp_path / "dst")
        log = proxy.request_log()
    assert read_tree(tmp_path / "dst") == files
    cuts = [e for e in log if e["cut"]]
    assert cuts, "the proxy cut no body: the test proved nothing"
    for cut in cuts:
        first, last = (int(x) for x in cut["range"].removeprefix("bytes=").split("-"))
        later = [e["range"] for e in log if e["start"] >= cut["end"] and key_of(e) == key_of(cut)]
        resumed = [r for r in later if r.endswith(f"-{last}")]
        # the retry asks only for what is missing: it starts past the cut range's start
        assert resumed and all(int(r.removeprefix("bytes=").split("-")[0]) > first for r in resumed)


def test_flaky_and_cut_ranges_still_give_identical_bytes(s3_server, s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = sized_checkpoint(src)
    S3Store(s3_url, **RANGED, **FAST).upload_dir(src, "step_3")
    with FlakyProxy(s3_server.endpoint, error_rate=0.2, cut_rate=0.2, seed=5) as proxy:
        store = S3Store(s3_url, proxy.endpoint, max_attempts=12, **RANGED, **FAST)
        store.download_dir("step_3", tmp_path / "dst")
        stats = proxy.stats()
    assert read_tree(tmp_path / "dst") == files
    assert stats["injected"] > 0 and stats["cut"] > 0


def test_a_range_that_keeps_failing_is_retryable(s3_server, s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    sized_checkpoint(src)
    S3Store(s3_url, **RANGED, **FAST).upload_dir(src, "step_3")
    with FlakyProxy(s3_server.endpoint, error_rate=0.0, cut_rate=1.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint, max_attempts=3, **RANGED, **FAST)
        with pytest.raises(RetryableStorageError, match="still failing after 3 attempts"):
            store.download_dir("step_3", tmp_path / "dst")


def test_an_object_replaced_or_shorter_than_listed_is_terminal(s3_url: str, tmp_path: Path) -> None:
    from gpufleet.checkpoint.storage.s3.client import _Job
    from gpufleet.checkpoint.storage.s3.download import fetch

    src = tmp_path / "src"
    sized_checkpoint(src)
    store = S3Store(s3_url, **RANGED, **FAST)
    store.upload_dir(src, "step_3")
    key = f"{store.prefix}/step_3/many.bin"
    store._sleep = lambda s: pytest.fail("a terminal error must not be retried")
    # Another version than the one listed (If-Match fails: 412), and a size the object no longer has.
    with pytest.raises(TerminalStorageError, match="412|PreconditionFailed"):
        fetch(store, [_Job(key, tmp_path / "a.bin", 5 * PART + 7, '"0123456789abcdef0123456789abcdef"')])
    with pytest.raises(TerminalStorageError, match="object changed|416|InvalidRange"):
        fetch(store, [_Job(key, tmp_path / "b.bin", 5 * PART + 7 + 3 * PART)])


def test_local_write_error_is_terminal(s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    sized_checkpoint(src)
    store = S3Store(s3_url, **RANGED, **FAST)
    store.upload_dir(src, "step_3")
    dst = tmp_path / "dst"
    (dst / "sub").mkdir(parents=True)
    (dst / "sub" / "dir").write_text("a file where a directory must go")
    with pytest.raises(TerminalStorageError, match="cannot create|local I/O"):
        store.download_dir("step_3", dst)


def test_adaptive_plan_fetches_small_objects_whole_and_splits_large_ones(
    s3_server, s3_url: str, tmp_path: Path
) -> None:
    """No range_size: about one range per worker's share, small objects in one GET each."""
    from gpufleet.checkpoint.storage.s3.download import RANGE_MIN, plan_range_size

    src = tmp_path / "src"
    files = {
        "big.bin": os.urandom(3 * RANGE_MIN + 5),
        "small.bin": os.urandom(RANGE_MIN // 2),
        "tiny.bin": b"t" * 100,
        "manifest.json": b'{"step": 3}',
    }
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    S3Store(s3_url, multipart_threshold=64 * MiB, **FAST).upload_dir(src, "step_3")
    with FlakyProxy(s3_server.endpoint, error_rate=0.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint, max_concurrency=2, **FAST)
        store.download_dir("step_3", tmp_path / "dst")
        gets = range_gets(proxy.request_log())
    assert read_tree(tmp_path / "dst") == files
    step = plan_range_size(sum(len(v) for k, v in files.items() if k != "manifest.json"), 2)
    assert step == 15 * MiB  # (28 MiB + 105 bytes) / 2 workers, rounded up to whole MiB
    assert gets["small.bin"] == [f"bytes=0-{RANGE_MIN // 2 - 1}"]
    assert gets["tiny.bin"] == ["bytes=0-99"]
    size = len(files["big.bin"])
    assert sorted(gets["big.bin"]) == [f"bytes=0-{step - 1}", f"bytes={step}-{size - 1}"]


# ----------------------------------------------------------------------------- streaming upload
def test_streaming_upload_sends_each_file_once_the_rest_from_disk(
    s3_server, s3_url: str, tmp_path: Path
) -> None:
    """Parts go while the file is written; with every slot busy the rest comes from the local file
    after the commit, into the same multipart upload. Nothing is visible before the manifest."""
    src = tmp_path / "src"
    files = make_checkpoint(src, big_mib=12)
    big, small = files["__0_0.distcp"], files["__1_0.distcp"]
    assert len(small) < 5 * MiB
    with FlakyProxy(s3_server.endpoint, error_rate=0.0) as proxy:
        store = S3Store(s3_url, proxy.endpoint, **SMALL_PARTS, max_concurrency=2, **FAST)
        stream = store.streaming_upload("step_7")
        sink = stream.stream("__0_0.distcp")
        sink.write(big[: 6 * MiB])  # a first 5 MiB part goes at once ...
        held = [stream.slots.acquire() for _ in range(2)]  # (waits for it) ... then every slot is busy:
        sink.write(memoryview(big)[6 * MiB :])  # the rest of this file is left to the local copy
        stream.stream("__1_0.distcp").write(small)  # below one part: left to one plain PUT
        for _ in held:
            stream.slots.release()
        assert store.list_prefixes() == []
        uploaded = stream.finish(src)
        assert uploaded == {"__0_0.distcp": len(big)}
        assert store.list_prefixes() == []  # shards complete, no manifest yet: still invisible
        assert store.upload_dir(src, "step_7", uploaded=uploaded) == sum(len(v) for v in files.values())
        assert store.list_prefixes() == ["step_7"]
        log = proxy.request_log()
    S3Store(s3_url, **FAST).download_dir("step_7", tmp_path / "dst")
    assert read_tree(tmp_path / "dst") == files
    puts = [e["path"] for e in log if e["method"] == "PUT"]
    big_puts = [p for p in puts if "__0_0.distcp" in p]
    assert len(big_puts) == 3 and all("partNumber=" in p for p in big_puts)  # 5 + 5 + 2 MiB, never whole
    small_puts = [p for p in puts if "__1_0.distcp" in p]
    assert len(small_puts) == 1 and "partNumber=" not in small_puts[0]  # sent whole, once


def test_a_failed_stream_is_aborted_and_its_file_sent_whole(s3_server, s3_url: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_checkpoint(src, big_mib=12)
    with FlakyProxy(s3_server.endpoint, error_rate=0.0, seed=2) as ok_proxy:
        store = S3Store(s3_url, ok_proxy.endpoint, **SMALL_PARTS, **FAST)
        with FlakyProxy(s3_server.endpoint, error_rate=1.0) as bad:  # S3 down during the write
            broken = S3Store(
                s3_url, bad.endpoint, **SMALL_PARTS, max_attempts=2, botocore_max_attempts=1, **FAST
            )
            stream = broken.streaming_upload("step_8")
            stream.stream("__0_0.distcp").write(files["__0_0.distcp"])
            assert stream.finish(src) == {}  # nothing claimed: the upload below sends it whole
        assert store.list_prefixes() == []
        store.upload_dir(src, "step_8", uploaded={})
        whole = [e for e in ok_proxy.request_log() if e["method"] == "PUT" and "__0_0.distcp" in e["path"]]
    assert whole
    S3Store(s3_url, **FAST).download_dir("step_8", tmp_path / "dst")
    assert read_tree(tmp_path / "dst") == files
