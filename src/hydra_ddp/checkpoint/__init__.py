"""Checkpoints, in one package: finding and reading them (files; the launch side needs only this),
the two state layouts (layouts: whole, or each rank's shards), writing them whole or not at all
(atomic, checkpointer: rank 0's background writes, DCP's shards, exact-resume state), and the
loop's side (saving: when to save, resuming, the best weights)."""
