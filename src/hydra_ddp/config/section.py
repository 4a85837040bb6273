"""A config section: a dataclass that becomes read-only once the run's config is frozen
(run_config.freeze), and stays so in every worker it is sent to (the flag travels with it)."""

from __future__ import annotations

import dataclasses
from typing import Any


class Section:
    """Base of the schema's dataclasses: an assignment after `freeze()` raises."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(
                f"{type(self).__name__}.{name}: the run's config is read-only; make a new one "
                "(run_config.amended)"
            )
        object.__setattr__(self, name, value)

    def freeze(self) -> Any:
        """Read-only from here on, this section and every section inside it; returns it."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value.freeze()
        object.__setattr__(self, "_frozen", True)
        return self
