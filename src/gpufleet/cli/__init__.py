"""The ``gpufleet`` command line: one thin module per command group."""
