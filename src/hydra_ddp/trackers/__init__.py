"""Experiment trackers beyond the run's own files, an extra: Weights & Biases (wandb_logger.py).
TensorBoard, metrics.csv and MLflow's logger are the core's (reporting/loggers.py)."""
