"""A user project's conf/ searched ahead of the package's config groups (hydra_ddp.project).

Hydra appends `hydra.searchpath` entries after the primary config directory, so a project's
`model=my_model` would be found, but its `model/cnn.yaml` would not replace the built-in one, and
every command would need the flag. This plugin (Hydra imports every module of hydra_plugins at each
start: nothing heavy here) prepends the project's directory instead, unless it is the primary one
already (train.py in the repository).
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from hydra_ddp import project


class ProjectConfSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        conf = project.extra_conf(project.find())
        if conf is None:
            return
        primary = [e.path for e in search_path.get_path() if e.provider == "main" and e.path]
        if any(
            path.startswith("file://") and project.same_dir(path[len("file://") :], conf)
            for path in primary
        ):
            return  # the primary config directory already: train.py in this repository
        search_path.prepend(provider=project.PROVIDER, path=f"file://{conf}")
