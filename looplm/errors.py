"""The one exception type for bad user input.

Anything a user can get wrong (a recipe key, a value out of range, a missing run folder,
an unreadable data file) raises `UserError`; the CLI turns it into exit code 2 and one line
on stderr. Everything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user; the message names the field or file and what is allowed."""
