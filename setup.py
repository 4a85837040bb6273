"""The packages, with one mapping pyproject.toml cannot say beside a package search: the config
groups ship inside the package (hydra_ddp.conf, found by Hydra as pkg://hydra_ddp.conf) from the
one copy at the top of the repository, conf/, which train.py reads as it always has."""

from setuptools import find_namespace_packages, setup

CONF = ["hydra_ddp.conf", *(f"hydra_ddp.conf.{group}" for group in find_namespace_packages("conf"))]

setup(
    # hydra_ddp/template/ is hydra-ddp init's files, shipped as data: not a package of the project's.
    packages=[
        *find_namespace_packages("src", include=["hydra_ddp*", "hydra_plugins*"], exclude=["hydra_ddp.template*"]),
        *CONF,
    ],
    package_dir={"": "src", "hydra_ddp.conf": "conf"},
    package_data={**{package: ["*.yaml"] for package in CONF}, "hydra_ddp": ["template/**/*"]},
)
