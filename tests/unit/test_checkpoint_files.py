"""Reading checkpoints: one that an earlier release wrote is refused in one line naming that release
(tests/fixtures/checkpoint_0.1.0.pt: a checkpoint hydra-ddp 0.1.0 wrote, at a6b8f73)."""

from __future__ import annotations

import pytest

from hydra_ddp.checkpoint import files
from hydra_ddp.errors import UserError

from support import REPO

OLD = REPO / "tests" / "fixtures" / "checkpoint_0.1.0.pt"


def test_a_checkpoint_of_0_1_is_refused_in_one_line_that_names_it_and_this_version():
    with pytest.raises(UserError) as refused:
        files.read(OLD, "trainer.resume")
    line = str(refused.value)
    assert (
        "was written by hydra-ddp 0.1 (its config has keys this version renamed: dist.*, ddp.*)"
        in line
    )
    assert f"this version ({files.version()})" in line and "read it with hydra-ddp 0.1.0" in line
    assert "\n" not in line and files.version() != "0.1.0"  # the version moved when the keys broke
