"""A user's project (hydra_ddp.project), `hydra-ddp init` (hydra_ddp.init) and the command's bad
input (hydra_ddp.cli), in process. tests/e2e/test_package.py runs them from an installed wheel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hydra_ddp import cli, init, project
from hydra_ddp.errors import UserError

from support import REPO


def test_the_project_is_the_nearest_pyproject_with_a_hydra_ddp_table(tmp_path: Path):
    root = tmp_path / "lab"
    (root / "conf").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "lab"\n\n[tool.hydra-ddp]\n')
    below = root / "notebooks" / "today"
    below.mkdir(parents=True)
    assert project.find(below) == project.Project(root.resolve(), (root / "conf").resolve())
    (root / "pyproject.toml").write_text('[tool.hydra-ddp]\nconf = "configs"\n')
    with pytest.raises(UserError, match=r"conf = .*configs' is not a directory"):
        project.find(below)
    (root / "pyproject.toml").write_text("[tool.hydra-ddp")
    with pytest.raises(UserError, match="cannot be read"):
        project.find(below)


def test_without_a_table_a_conf_here_is_the_project_and_nothing_else_is(tmp_path: Path):
    assert project.find(tmp_path) is None
    (tmp_path / "conf").mkdir()
    assert project.find(tmp_path).conf == (tmp_path / "conf").resolve()


def test_a_project_option_with_a_built_in_name_is_said_in_one_line(tmp_path: Path):
    package = project.package_conf()
    mine = tmp_path / "conf"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "cnn.yaml").write_text("_target_: x.Y\n")
    (mine / "model" / "mine.yaml").write_text("_target_: x.Z\n")
    lines = project.shadowed(mine, package)
    assert lines == [
        f"hydra-ddp: {mine / 'model' / 'cnn.yaml'} replaces the built-in model=cnn "
        "(the project's file wins; rename it to keep both)"
    ]


def test_the_clones_own_conf_is_not_a_project_of_its_own():
    repo = Path(__file__).resolve().parents[2]
    assert project.extra_conf(project.Project(repo, repo / "conf")) is None


def test_init_writes_a_project_and_refuses_a_directory_that_is_not_empty(tmp_path: Path):
    folder, written = init.init(str(tmp_path / "My-Lab 2"))
    names = {str(p.relative_to(folder)) for p in written}
    assert {
        "pyproject.toml",
        "my_lab_2/task.py",
        "conf/experiment/spirals.yaml",
        "tests/test_train.py",
    } <= names
    text = "".join(p.read_text() for p in written)
    assert "{{" not in text and "my_lab_2.model.SpiralNet" in text
    with pytest.raises(UserError, match="is not an empty directory"):
        init.init(str(folder))
    assert (
        init.package_name(Path("class")) == "class_"
        and init.package_name(Path("3d")) == "project_3d"
    )


def test_the_tree_docs_project_md_shows_is_what_init_writes(tmp_path: Path):
    folder, written = init.init(str(tmp_path / "my-lab"))
    page = (REPO / "docs" / "project.md").read_text()
    tree = page.split("```text\nmy-lab/\n", 1)[1].split("```", 1)[0]
    shown = set()
    for line in tree.splitlines():
        # A line names one file, or several of one folder's ("conf/data/a.yaml, conf/model/b.yaml").
        shown |= (
            {name.strip() for name in line.split("  ")[1].split(",")} if line.strip() else set()
        )
    assert shown == {str(p.relative_to(folder)) for p in written}


def test_an_unknown_command_is_one_line(capsys):
    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err == (
        "hydra-ddp: error: no command 'trian'; choose "
        "train, eval, export, generate, init or warm (hydra-ddp --help)\n"
    )
    assert cli.main(["init"]) == 2
    assert "takes one argument" in capsys.readouterr().err
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0
    assert "hydra_ddp" in sys.modules
