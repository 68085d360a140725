"""The one exception type of the data layer."""


class DataError(ValueError):
    """Bad data input: the message names the argument (``--data-path``, ``--input``, ...) or the
    file at fault and says how to fix it. CLIs print it without a traceback."""
