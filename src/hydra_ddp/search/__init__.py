"""Hyperparameter search over whole DDP jobs on Optuna: the search space from Hydra's sweep syntax
(space), the study in a storage that survives a crash and what each trial's outcome was (study),
and, in the workers, a trial's pruning (hydra_ddp.search.pruning). The Hydra sweeper that joins
them is hydra_plugins.hydra_ddp_optuna."""
