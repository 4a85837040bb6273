"""The launch side: the command (command), the config made plain and checked against the pieces
(resolve, checks; eval.py's from a checkpoint: from_checkpoint), the workers it starts on this node
(workers), and the start-up's forkserver (startup, forkserver_*). Nothing here imports the worker
side: workers are started by the name of their entry (training.worker)."""
