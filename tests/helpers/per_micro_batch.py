"""A schedule stepped per micro-batch instead of per optimizer step (accelerate #963): the warmup
and cosine of schedules.warmup_cosine, advanced `micro_batches` steps for each optimizer step, for
tests/e2e/test_recipe.py to show that its rates catch it."""

from hydra_ddp.recipe import schedules


class PerMicroBatch(schedules.StepSchedule):
    micro_batches = 2

    def at(self, step: int) -> None:
        super().at(min(step * self.micro_batches, self.shape.total))


def warmup_cosine(optimizer, total_steps, **settings):
    made = schedules.warmup_cosine(optimizer, total_steps, **settings)
    return PerMicroBatch(optimizer, made.shape, made.name)
