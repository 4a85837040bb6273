"""The launch side: the command (command), the workers it starts on this node (workers), who is rank
0 before torch is imported (ranks), the start-up's forkserver (startup, forkserver_*), and train.py
--check from Python (preflight). Nothing here imports the worker side: workers are started by the
name of their entry (training.worker)."""
