"""``python -m gpufleet.backends.ray``: the node agent a Ray actor starts (:mod:`gpufleet.backends.ray.agent`)."""

from gpufleet.backends.ray.agent import main

raise SystemExit(main())
