"""The one exception type that reaches the user as a single line instead of a traceback."""


class UserError(Exception):
    """Something the user can fix (config, data, environment): says what is wrong and what to do."""

    exit_code = 2
