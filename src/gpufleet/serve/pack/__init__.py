"""``gpufleet serve pack`` (docs/serve-pack.md): read plans (plans), place their engine instances into
racks or nodes at the lowest cost with CP-SAT or first-fit decreasing (solver), render (render)."""

from gpufleet.serve._lazy import attach

__getattr__, __all__ = attach(
    __name__,
    {
        "plans": ["Group", "Item", "Workload", "load_plan", "load_plans", "items_of"],
        "solver": [
            "PackError",
            "PackInfeasible",
            "PackResult",
            "PackStatus",
            "Solver",
            "pack",
            "ffd",
            "capacity_bound",
        ],
        "render": ["headline", "tables", "plot_racks"],
    },
)
