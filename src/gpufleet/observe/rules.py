"""Prometheus alert rules for gpufleet's metrics (``gpufleet dashboard rules -o gpufleet-rules.yml``).

Rules read timestamps and states rather than ``increase()`` of counters where they can: the exporter
re-reads ledgers from the start when it restarts, so a counter can appear already at its total, and
``increase()`` would miss what happened while nobody scraped. A timestamp gauge
("newest checkpoint failure at t") says the same thing and survives restarts.

Each rule also names ``reads``: a selector of the metric it is built on. A test runs that selector
too, so a rule that is silent is silent because nothing is wrong, not because a name is misspelt.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AlertRule", "RULES", "rules_yaml"]


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One alerting rule (Prometheus rule-file fields) and the metric it reads."""

    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    reads: str  # a selector of the underlying metric: returns data whenever the exporter runs


RULES: tuple[AlertRule, ...] = (
    AlertRule(
        name="GpufleetRunStalled",
        expr="gpufleet_run_running == 1 and on (run) "
        "(time() - gpufleet_train_last_progress_timestamp_seconds) > 900",
        for_="5m",
        severity="critical",
        summary="Run {{ $labels.run }} has made no step for 15 minutes",
        description="The supervisor is still running but no step completed for 15 minutes: a hang the "
        "hang detector did not catch, a slow restore, or a stuck supervisor. See `gpufleet report`.",
        reads="gpufleet_train_last_progress_timestamp_seconds",
    ),
    AlertRule(
        name="GpufleetBreakerTripped",
        expr='gpufleet_run_status{status=~"no_progress|max_restarts|max_rollbacks|nodes_lost"} == 1',
        for_="0m",
        severity="critical",
        summary="Run {{ $labels.run }} stopped: {{ $labels.status }} breaker",
        description="gpufleet gave up on the run: restarts made no checkpoint progress (no_progress), "
        "or a restart/rollback budget was used up, or too few nodes were left. It needs a person.",
        reads="gpufleet_run_status",
    ),
    AlertRule(
        name="GpufleetDrainedNodeSurge",
        expr='count(time() - gpufleet_node_state_since_timestamp_seconds{state="drained"} < 900) >= 3',
        for_="0m",
        severity="warning",
        summary="{{ $value }} nodes were drained within 15 minutes",
        description="Several nodes were drained at once: more likely a fabric, storage or software "
        "problem than several bad nodes. Check before draining more (`gpufleet nodes`).",
        reads="gpufleet_node_state_since_timestamp_seconds",
    ),
    AlertRule(
        name="GpufleetCheckpointFailures",
        expr="(time() - gpufleet_checkpoint_last_failure_timestamp_seconds) < 3600",
        for_="0m",
        severity="warning",
        summary="Run {{ $labels.run }} had a failed checkpoint within the hour",
        description="A checkpoint failed to persist (or upload). Training goes on from the previous "
        "one; repeated failures mean a restart would lose more work. See `gpufleet report`.",
        reads="gpufleet_checkpoints_total",
    ),
    AlertRule(
        name="GpufleetCheckpointsFailing",
        expr="gpufleet_checkpoint_last_failure_timestamp_seconds "
        "> on (run) gpufleet_checkpoint_last_commit_timestamp_seconds",
        for_="15m",
        severity="critical",
        summary="Run {{ $labels.run }}: no checkpoint committed since the last failure",
        description="The newest checkpoint attempt failed and none committed since: a restart now "
        "would lose everything since the last commit.",
        reads="gpufleet_checkpoint_last_commit_timestamp_seconds",
    ),
)


def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def rules_yaml(rules: tuple[AlertRule, ...] = RULES, group: str = "gpufleet") -> str:
    """The rule file (YAML, written by hand to keep its layout readable and PyYAML optional)."""
    lines = ["groups:", f"  - name: {group}", "    rules:"]
    for r in rules:
        lines += [
            f"      - alert: {r.name}",
            f"        expr: {_q(r.expr)}",
            f"        for: {r.for_}",
            "        labels:",
            f"          severity: {r.severity}",
            "        annotations:",
            f"          summary: {_q(r.summary)}",
            f"          description: {_q(r.description)}",
        ]
    return "\n".join(lines) + "\n"
