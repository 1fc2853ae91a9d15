"""``python -m gpufleet.backends.ray``: the node agent that a Ray actor starts (:mod:`.agent`)."""

from gpufleet.backends.ray.agent import main

raise SystemExit(main())
