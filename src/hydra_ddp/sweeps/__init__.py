"""A multirun's reports, an extra: the scaling report over world sizes and its figure (a Hydra
callback: scaling.py, scaling_plot.py), or any other sweep's and a search's trials ranked by their
objective (trials.py)."""
