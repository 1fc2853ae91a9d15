"""``python -m gpufleet.backends.k8s``: the worker pod's agent (:mod:`gpufleet.backends.k8s.agent`)."""

from gpufleet.backends.k8s.agent import main

raise SystemExit(main())
