"""The glue for a cluster's own way of starting a job (an extra): a Kubernetes pod's PET_* variables
as launch settings (kubernetes). Slurm's is the launcher plugin (hydra_plugins/hydra_ddp_slurm);
the ranks every launcher's variables give are runtime/ranks.py's, which every launch reads."""
