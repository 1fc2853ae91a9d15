"""The Prometheus side: a ``prometheus_client`` collector over :class:`~gpufleet.observe.sources.Sources`,
served over HTTP (loopback by default), written as a node-exporter textfile, or pushed to a Pushgateway.

The collector reads its sources at scrape time (incrementally), so an exporter that nobody scrapes
costs nothing, and one inside ``gpufleet run --metrics`` costs the supervisor a read of the new
ledger lines per scrape and nothing per step.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.core.errors import UsageError
from gpufleet.observe.sources import SPECS, Hist, Sample, Sources

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["Listen", "parse_listen", "GpufleetCollector", "registry_for", "exposition", "Exporter", "live",
           "serve", "write_textfile", "push"]  # fmt: skip

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Listen:
    """Where the exporter listens: ``[ADDR:]PORT``, the address loopback unless given."""

    host: str
    port: int

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


def parse_listen(text: str, flag: str = "--metrics") -> Listen:
    """``9400``, ``127.0.0.1:9400``, ``0.0.0.0:9400`` or ``[::1]:9400`` (port 0: any free port)."""
    raw = text.strip()
    host, sep, port_s = raw.rpartition(":")
    if not sep:
        host, port_s = LOOPBACK, raw
    host = host.strip("[]") or LOOPBACK
    try:
        port = int(port_s)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected [ADDR:]PORT, e.g. 9400 or 127.0.0.1:9400") from None
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag} {text!r}: port must be 0..65535")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {host!r} is not an IP address (or localhost)") from None
    return Listen(host, port)


def check_bindable(where: Listen, flag: str = "--listen") -> None:
    """Bind ``where`` and let go: a busy or foreign address fails here, in one line, before a server
    announces itself (port 0 always binds)."""
    family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((where.host, where.port))
    except OSError as e:
        reason = e.strerror or str(e)
        raise UsageError(f"{flag} {where.host}:{where.port}: cannot listen there: {reason}") from None


class GpufleetCollector:
    """Reads the sources at each ``collect()`` (one scrape at a time) and yields metric families."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []  # families depend on the files; nothing to describe up front

    def collect(self) -> Iterator[Any]:
        with self._lock:
            self.sources.refresh()
            samples = list(self.sources.samples())
        yield from families(samples)


def families(samples: Iterable[Sample]) -> Iterator[Any]:
    """``prometheus_client`` metric families for samples (in :data:`SPECS` order)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    fams: dict[str, Any] = {}
    for s in samples:
        spec = SPECS[s.name]
        fam = fams.get(s.name)
        if fam is None:
            labels = list(spec.labels)
            if spec.kind == "counter":
                fam = CounterMetricFamily(spec.name, spec.help, labels=labels)
            elif spec.kind == "histogram":
                fam = HistogramMetricFamily(spec.name, spec.help, labels=labels)
            else:
                fam = GaugeMetricFamily(spec.name, spec.help, labels=labels)
            fams[s.name] = fam
        if isinstance(s.value, Hist):
            fam.add_metric(list(s.labels), s.value.cumulative(), s.value.total)
        else:
            fam.add_metric(list(s.labels), s.value)
    for name in SPECS:
        if name in fams:
            yield fams[name]


def registry_for(sources: Sources) -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(GpufleetCollector(sources))  # type: ignore[arg-type]
    return reg


def exposition(sources: Sources) -> bytes:
    """The text exposition format of one scrape."""
    from prometheus_client import generate_latest

    return generate_latest(registry_for(sources))


class Exporter:
    """A running HTTP exporter (``/metrics``); ``close()`` stops it."""

    def __init__(self, sources: Sources, listen: Listen) -> None:
        from prometheus_client import start_http_server

        self.sources = sources
        try:
            self._server, self._thread = start_http_server(listen.port, listen.host, registry_for(sources))
        except OSError as e:
            raise UsageError(f"cannot listen on {listen.host}:{listen.port}: {e.strerror or e}") from None
        host, port = self._server.server_address[:2]
        self.listen = Listen(str(host), int(port))

    @property
    def url(self) -> str:
        host = f"[{self.listen.host}]" if ":" in self.listen.host else self.listen.host
        return f"http://{host}:{self.listen.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(sources: Sources, listen: Listen) -> Exporter:
    """Start serving ``/metrics`` in a daemon thread."""
    return Exporter(sources, listen)


def live(
    run_dir: str | os.PathLike[str], listen: str | Listen, fleet_dir: str | os.PathLike[str] | None = None
) -> Exporter:
    """The exporter ``gpufleet run --metrics`` starts beside its supervisor: that run (and the fleet)."""
    where = parse_listen(listen) if isinstance(listen, str) else listen
    return Exporter(Sources(runs=[run_dir], fleet_dir=fleet_dir), where)


def write_textfile(sources: Sources, path: str | os.PathLike[str]) -> Path:
    """Write one scrape for node-exporter's textfile collector (atomically: temp file, rename)."""
    from prometheus_client import write_to_textfile

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(p), registry_for(sources))
    return p


def push(sources: Sources, gateway: str, job: str, grouping: dict[str, str] | None = None) -> None:
    """Push one scrape to a Prometheus Pushgateway (replacing the group's metrics)."""
    from prometheus_client import push_to_gateway

    try:
        push_to_gateway(
            gateway, job=job, registry=registry_for(sources), grouping_key=grouping or {}, timeout=15
        )
    except OSError as e:
        from gpufleet.core.errors import GpufleetError

        raise GpufleetError(f"push to {gateway} failed: {e}") from None
