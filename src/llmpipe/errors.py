"""Errors that mean the user must change something: the CLI prints their message alone and exits 2."""


class UserError(ValueError):
    """A mistake in params, data or the command line; the message names the file/key/line and the fix."""
