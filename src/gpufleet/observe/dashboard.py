"""The Grafana dashboard, built with ``grafana-foundation-sdk`` (the typed builder, not JSON by hand).

Three rows: the fleet (node states, failures by component, lemons, health checks), a training run
(progress, step time, goodput, the badput stack, MTTR phases, checkpoint stall and persist,
restarts) and serving (latency percentiles against the SLO, attainment, goodput). Every query uses
only metrics of :data:`gpufleet.observe.sources.SPECS`; tests run each one against a real
Prometheus scraping a real run. ``$run``, ``$node`` and ``$bench`` are multi-value variables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["PanelSpec", "PANELS", "ROWS", "build", "export_json", "queries"]

Viz = Literal["timeseries", "stat", "table", "bargauge", "bars"]


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """One panel: title, kind, unit, and its PromQL queries as (expr, legend)."""

    row: str
    title: str
    viz: Viz
    unit: str
    targets: tuple[tuple[str, str], ...]
    description: str = ""
    stacked: bool = False
    instant: bool = False  # tables and bar gauges show the newest value only


RUN = 'run=~"$run"'
BENCH = 'bench=~"$bench"'
NODE = 'node=~"$node"'
RI = "$__rate_interval"

ROWS = ("Fleet overview", "Training run", "Serving")

PANELS: tuple[PanelSpec, ...] = (
    # ------------------------------------------------------------------ fleet
    PanelSpec("Fleet overview", "Nodes by state", "bargauge", "none",
              ((f"sum by (state) (gpufleet_node_state{{{NODE}}})", "{{state}}"),), instant=True,
              description="Current node states from the fleet ledger (gpufleet nodes)."),
    PanelSpec("Fleet overview", "Failures by component", "bargauge", "none",
              ((f"sum by (component) (gpufleet_node_failures_total{{{NODE}}})", "{{component}}"),),
              instant=True, description="Node failures (into suspect or drained) by the part blamed."),
    PanelSpec("Fleet overview", "Lemon nodes", "table", "none",
              ((f"gpufleet_node_lemon{{{NODE}}} == 1", "{{node}}"),), instant=True,
              description="Nodes that failed too often within the lemon window (exclude them)."),
    PanelSpec("Fleet overview", "Drained and suspect nodes", "table", "none",
              ((f'gpufleet_node_state{{{NODE},state=~"drained|suspect"}} == 1', "{{node}} {{state}}"),),
              instant=True, description="Nodes out of service now, and why (component, check)."),
    PanelSpec("Fleet overview", "Health checks not OK", "bargauge", "none",
              ((f'sum by (check, status) (gpufleet_health_check_status{{{NODE},status!="OK"}})',
                "{{check}} {{status}}"),), instant=True,
              description="Newest result per node, check and device that is WARN, FAIL or INCOMPLETE."),
    # ------------------------------------------------------------------ training
    PanelSpec("Training run", "Step rate", "timeseries", "none",
              ((f"rate(gpufleet_train_steps_total{{{RUN}}}[{RI}])", "{{run}} steps/s"),),
              description="Step executions per second (replayed steps count)."),
    PanelSpec("Training run", "Progress (newest productive step)", "timeseries", "none",
              ((f"gpufleet_train_last_step{{{RUN}}}", "{{run}}"),)),
    PanelSpec("Training run", "Step time p50 / p95", "timeseries", "s",
              ((f"histogram_quantile(0.5, sum by (le, run) "
                f"(rate(gpufleet_train_step_duration_seconds_bucket{{{RUN}}}[{RI}])))", "{{run}} p50"),
               (f"histogram_quantile(0.95, sum by (le, run) "
                f"(rate(gpufleet_train_step_duration_seconds_bucket{{{RUN}}}[{RI}])))", "{{run}} p95"))),
    PanelSpec("Training run", "Goodput", "timeseries", "percentunit",
              ((f"gpufleet_train_goodput_ratio{{{RUN}}}", "{{run}}"),),
              description="Productive step time / wall time, as gpufleet report."),
    PanelSpec("Training run", "Where the time went (badput stack)", "timeseries", "s",
              ((f"gpufleet_train_time_seconds{{{RUN}}}", "{{run}} {{category}}"),), stacked=True,
              description="Productive time and each badput category; they sum to the wall time."),
    PanelSpec("Training run", "MTTR by phase (mean)", "bars", "s",
              ((f"gpufleet_train_mttr_phase_seconds{{{RUN}}}", "{{run}} {{phase}}"),), stacked=True,
              instant=True, description="detect + teardown + spawn_init + load + first_step = MTTR."),
    PanelSpec("Training run", "Restarts and failures by cause", "bargauge", "none",
              ((f"sum by (cause) (gpufleet_train_restarts_total{{{RUN}}})", "restarts {{cause}}"),
               (f"sum by (cause) (gpufleet_train_failures_total{{{RUN}}})", "failures {{cause}}")),
              instant=True),
    PanelSpec("Training run", "Attempt and world size", "timeseries", "none",
              ((f"gpufleet_run_attempt{{{RUN}}}", "{{run}} attempt"),
               (f"gpufleet_run_world_size{{{RUN}}}", "{{run}} world size"))),
    PanelSpec("Training run", "Checkpoint stall and persist p95", "timeseries", "s",
              ((f"histogram_quantile(0.95, sum by (le, run) "
                f"(gpufleet_checkpoint_stall_seconds_bucket{{{RUN}}}))", "{{run}} stall p95"),
               (f"histogram_quantile(0.95, sum by (le, run) "
                f"(gpufleet_checkpoint_persist_seconds_bucket{{{RUN}}}))", "{{run}} persist p95")),
              description="Over the whole run: training blocked per checkpoint, and stage end to commit."),
    PanelSpec("Training run", "Checkpoints committed and failed", "timeseries", "none",
              ((f'gpufleet_checkpoints_total{{{RUN},outcome=~"committed|failed"}}', "{{run}} {{outcome}}"),)),
    PanelSpec("Training run", "MTBF and MTTR", "stat", "s",
              ((f"gpufleet_train_mtbf_seconds{{{RUN}}}", "{{run}} MTBF"),
               (f"gpufleet_train_mttr_seconds{{{RUN}}}", "{{run}} MTTR"))),
    # ------------------------------------------------------------------ serving
    PanelSpec("Serving", "Latency percentiles against the SLO", "timeseries", "s",
              ((f"gpufleet_serve_latency_seconds{{{BENCH}}}", "{{bench}} {{metric}} {{percentile}}"),
               (f"gpufleet_serve_slo_limit_seconds{{{BENCH}}}", "{{bench}} {{metric}} SLO"))),
    PanelSpec("Serving", "SLO attainment", "stat", "percentunit",
              ((f"gpufleet_serve_slo_attainment_ratio{{{BENCH}}}", "{{bench}}"),)),
    PanelSpec("Serving", "Goodput and throughput", "timeseries", "reqps",
              ((f"gpufleet_serve_goodput_requests_per_second{{{BENCH}}}", "{{bench}} goodput"),
               (f"gpufleet_serve_throughput_requests_per_second{{{BENCH}}}", "{{bench}} throughput"))),
)  # fmt: skip


def _variable(name: str, metric: str, label: str) -> Any:
    from grafana_foundation_sdk.builders.dashboard import QueryVariable
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    return (
        QueryVariable(name)
        .label(name)
        .datasource(DataSourceRef(type_val="prometheus", uid="${datasource}"))
        .query(f"label_values({metric}, {label})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def _panel(p: PanelSpec) -> Any:
    from grafana_foundation_sdk.builders import bargauge, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig, VizLegendOptions
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, StackingMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    builder: Any
    newest = ReduceDataOptions().calcs(["lastNotNull"]).values(False)
    if p.viz in ("timeseries", "bars"):
        legend = VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
        builder = timeseries.Panel().legend(legend.placement(LegendPlacement.BOTTOM).calcs([]))
        if p.stacked:
            builder = builder.stacking(StackingConfig().mode(StackingMode.NORMAL))
    elif p.viz == "stat":
        builder = stat.Panel().reduce_options(newest)
    elif p.viz == "table":
        builder = table.Panel().show_header(True)
    else:
        builder = bargauge.Panel().reduce_options(newest)
    builder = builder.title(p.title).unit(p.unit).span(8).height(8)
    builder = builder.datasource(DataSourceRef(type_val="prometheus", uid="${datasource}"))
    if p.description:
        builder = builder.description(p.description)
    for i, (expr, legend) in enumerate(p.targets):
        q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
        builder = builder.with_target(q.instant() if p.instant else q.range())
    return builder


def build(title: str = "gpufleet", uid: str = "gpufleet-overview") -> Any:
    """The dashboard builder (``.build()`` gives the model)."""
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row

    d = (
        Dashboard(title)
        .uid(uid)
        .tags(["gpufleet", "generated"])
        .description("Fleet, training and serving goodput from gpufleet's exporter (gpufleet metrics).")
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(_variable("node", "gpufleet_node_state", "node"))
        .with_variable(_variable("run", "gpufleet_run_running", "run"))
        .with_variable(_variable("bench", "gpufleet_serve_bench_timestamp_seconds", "bench"))
    )
    for row in ROWS:
        d = d.with_row(Row(row))
        for p in PANELS:
            if p.row == row:
                d = d.with_panel(_panel(p))
    return d


def export_json(title: str = "gpufleet", uid: str = "gpufleet-overview") -> str:
    """The dashboard as Grafana JSON (import it, or provision it)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return JSONEncoder(sort_keys=True, indent=2).encode(build(title, uid).build()) + "\n"


def queries(dashboard_json: str | dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel of an exported dashboard."""
    d = json.loads(dashboard_json) if isinstance(dashboard_json, str) else dashboard_json
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets") or ():
                if t.get("expr"):
                    out.append((str(p.get("title", "")), str(t["expr"])))
            walk(p.get("panels") or [])

    walk(d.get("panels") or [])
    return out
