"""The config: its schema (schema), the composed config resolved once into what the workers receive
(resolve), checked (checks), eval.py's from a checkpoint (from_checkpoint), and one-line errors for
groups that do not fit together (groups)."""
