"""Where checkpoint bytes live: one module per storage tier.

- :mod:`~gpufleet.checkpoint.storage.local`: the checkpoint directory on the node's filesystem, the
  tier every save commits to first (DCP's writer and readers, checksummed; the commit itself);
- :mod:`~gpufleet.checkpoint.storage.memory`: whole commits kept in this node's shared memory;
- :mod:`~gpufleet.checkpoint.storage.peer`: each node's part of a commit replicated to a peer node's
  memory (ranks on several nodes);
- :mod:`~gpufleet.checkpoint.storage.s3`: committed checkpoints copied to an S3-compatible store.

The engine (:mod:`gpufleet.checkpoint.engine`) decides what goes to which tier and when;
:mod:`gpufleet.checkpoint.restore` decides which tier a restore reads from.
"""
