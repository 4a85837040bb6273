"""A warm start (`hydra-ddp warm`, docs/startup.md): one process keeps torch, Hydra and the project
imported, and each train.py or eval.py command runs in a fork of it.

    command.py   the command's side: run in a fork, or return to start cold; start, ask, stop
    server.py    the warm process: fork a command per request, answer its outcome
    facts.py     what a process is beyond its arguments: what a fork shares, refuses or takes
    wire.py      one message: a length and a pickle, the first with the command's descriptors

An extra (docs/architecture.md): the core launches cold without it.
"""
