"""The directory ``gpufleet run`` puts first on each rank's ``PYTHONPATH``: its ``sitecustomize``
starts the step telemetry (:mod:`gpufleet.train.autostep`)."""
