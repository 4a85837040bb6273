"""The exception types that reach the user as a single line instead of a traceback."""


class UserError(Exception):
    """Something the user can fix (config, data, environment): says what is wrong and what to do."""

    exit_code = 2


class EveryRankError(UserError):
    """Raised by every rank at the same point, on a decision they share (a diverged loss, a failed
    checkpoint write): the launcher reports it once, as the run's, not as one rank's."""
