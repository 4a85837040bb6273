"""Tasks: what is learnt. A task turns a batch into the training loss, names the metrics an
evaluation reports (each from sums that add up exactly) and says what eval.py's predictions hold.

conf/task/*.yaml chooses one by `_target_`: the built-in ones below, or a user's own class
(`_target_: my_package.MyTask`, a subclass of `Task`).
"""

from hydra_ddp.tasks.base import (  # noqa: F401
    RESERVED,
    Task,
    build,
    checked_loss,
    first_loss,
    fit_targets,
    misfit,
    monitor_of,
    weighs_units,
    worst_for,
)
from hydra_ddp.tasks.causal_lm import CausalLM, packing_warning  # noqa: F401
from hydra_ddp.tasks.classification import Classification, LanguageModel  # noqa: F401
from hydra_ddp.tasks.dense import Regression, Segmentation  # noqa: F401
