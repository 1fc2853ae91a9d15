"""Observability: the Prometheus exporter, the Grafana dashboard, alert rules and the MCP server.

Everything here reads what the rest of gpufleet writes (run ledgers, the fleet ledger, serve-bench
summaries) and computes numbers with the same functions ``gpufleet report`` and ``gpufleet nodes``
use, so a metric and a report never disagree. Heavy libraries (``prometheus_client``,
``grafana_foundation_sdk``, ``mcp``) are imported inside functions: ``pip install 'gpufleet[observe]'``.

Modules: ``tail`` (incremental ledger reading), ``sources`` (run, fleet and serve-bench sources and
their samples), ``exporter`` (the ``prometheus_client`` collector, HTTP, textfile, Pushgateway),
``dashboard`` (the Grafana dashboard), ``rules`` (Prometheus alert rules), ``mcp_server``.
"""

from __future__ import annotations
