"""This process at run time, beneath everything else: who it is (ranks), its kin (processes), the
signals that stop it, its log (ranklog) and its hangs (hangs). Imports nothing of the package's
but errors and rundir: every layer above may ask it."""
