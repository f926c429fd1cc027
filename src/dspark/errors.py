"""The one exception users see: it says what is wrong and how to fix it. The CLI turns it into exit code 2."""


class DSparkError(Exception):
    """A user-facing error: bad input, a missing package, a mismatched checkpoint."""
