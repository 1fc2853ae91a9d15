"""The local tier: checkpoint directories on the node's filesystem.

- :mod:`.writer`: a DCP storage writer that checksums every file while writing it;
- :mod:`.commit`: publishing a written directory (rename, then the manifest last) and removing one
  (the manifest first), so a reader never sees half a checkpoint;
- :mod:`.reader` and :mod:`.onepass`: reading tensors straight into place, and the one-pass
  verified read of a whole commit.
"""
