"""{{name}}: a task, a model and a dataset for hydra-ddp (conf/ names them by their import
paths)."""
