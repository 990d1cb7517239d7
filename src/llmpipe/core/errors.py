"""Errors that mean the user must change something: the CLI prints their message alone and exits 2."""


class UserError(ValueError):
    """A mistake in params, data or the command line; the message names the file/key/line and the fix."""


def root_cause(err: BaseException) -> str:
    """The innermost exception of a chain, on one line (libraries wrap the useful one), at most 400 chars."""
    while (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:400]}"
