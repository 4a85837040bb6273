"""Runs the script given as the first argument with one more override that differs by rank:
ranks of one run that were handed different configs (as a misconfigured node would be)."""

import os
import runpy
import sys

script = sys.argv[1]
sys.argv = [script, *sys.argv[2:], f"optim.lr={0.01 * (1 + int(os.environ['RANK']))}"]
runpy.run_path(script, run_name="__main__")
