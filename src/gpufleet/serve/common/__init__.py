"""What more than one serve subpackage uses: the SLO type and the ``--slo`` grammar, workloads and
length distributions, rack types (NVLink domains) and the plan-file format (written by ``plan``,
read by ``pack``)."""

from gpufleet.serve._lazy import attach

__getattr__, __all__ = attach(
    __name__,
    {
        "slo": ["SLO", "Limit", "Metric", "METRICS", "parse_slo"],
        "plan_format": ["PLAN_SCHEMA", "PLAN_VERSION", "Mode"],
        "workload": [
            "LengthDist",
            "RequestSpec",
            "SyntheticWorkload",
            "TraceEntry",
            "TraceWorkload",
            "Workload",
            "PRESETS",
            "BLOCK_TOKENS",
            "parse_dist",
            "parse_spec",
            "load_mooncake",
            "load_workload",
        ],
        "racks": [
            "DomainKind",
            "RackType",
            "Domain",
            "RACK_TYPES",
            "rack_type",
            "parse_racks",
            "parse_nodes",
            "build_fleet",
        ],
    },
)
