"""Tools beside training: the tuner of the fast settings (tune) and of the data loader
(tune_loader), and the writer of shard directories (shards)."""
