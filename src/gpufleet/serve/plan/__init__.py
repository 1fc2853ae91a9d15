"""``gpufleet serve profile`` and ``gpufleet serve plan`` (docs/serve-plan.md): latency profiles
(profile, measured by sweep), traffic, the continuous-batching simulator (sim), and the capacity
planner (model, shapes, evaluate, planner) with what a plan turns into (launch)."""

from gpufleet.serve._lazy import attach

__getattr__, __all__ = attach(
    __name__,
    {
        "profile": [
            "Coeffs",
            "TpProfile",
            "Profile",
            "fit_prefill",
            "fit_decode",
            "load_profile",
            "example_profiles",
            "profile_from_table",
        ],
        "sweep": ["measure"],
        "traffic": ["Traffic", "parse_traffic", "load_traffic"],
        "sim": ["Requests", "SimResult", "simulate_aggregated", "simulate_disaggregated", "evaluate"],
        "model": ["PlanOptions", "Candidate", "PlanResult", "pd_units"],
        "planner": ["plan", "replan", "system_max_rate"],
        "launch": ["plan_document", "candidate_from_plan", "pareto_png"],
    },
)
