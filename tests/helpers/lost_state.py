"""A step that drops the optimizer's state as its run starts (a resumed run: what it loaded), the
bug of FSDP2's optimizer state lost between a save and a load (accelerate #3971), for
tests/e2e/test_strategy.py to show that its comparison catches it."""

from hydra_ddp.training.step import Step


class DropsOptimizerState(Step):
    dropped = False

    def update(self):
        if not self.dropped:  # SGD's momentum begins anew
            self.optimizer.state.clear()
            self.dropped = True
        super().update()
