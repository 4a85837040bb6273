"""The packages, with two mappings pyproject.toml cannot say beside a package search: the config
groups ship inside the package (hydra_ddp.conf, found by Hydra as pkg://hydra_ddp.conf) from the
one copy at the top of the repository, conf/, which train.py reads as it always has; and
hydra_ddp/template/ (hydra-ddp init's files) ships whole, each of its folders named to setuptools
as a package so that the build says nothing of them (it warns of data folders it was not told
of)."""

import shutil
from pathlib import Path

from setuptools import find_namespace_packages, setup

# setuptools builds a wheel in the source tree's build/ (pip builds in place): a clone that was
# `pip install`ed is left as it was, without it (a build/ that was there before stays).
BUILD = Path(__file__).resolve().parent / "build"
BUILD_WAS_THERE = BUILD.exists()

CONF = ["hydra_ddp.conf", *(f"hydra_ddp.conf.{group}" for group in find_namespace_packages("conf"))]
TEMPLATE = [
    "hydra_ddp.template",
    *(
        f"hydra_ddp.template.{folder}"
        for folder in find_namespace_packages("src/hydra_ddp/template", exclude=["*__pycache__*"])
    ),
]

setup(
    packages=[
        *find_namespace_packages(
            "src", include=["hydra_ddp*", "hydra_plugins*"], exclude=["hydra_ddp.template*"]
        ),
        *TEMPLATE,
        *CONF,
    ],
    package_dir={"": "src", "hydra_ddp.conf": "conf"},
    package_data={
        **{package: ["*.yaml"] for package in CONF},
        **{package: ["*"] for package in TEMPLATE},
    },
)

if not BUILD_WAS_THERE:
    shutil.rmtree(BUILD, ignore_errors=True)
