"""The one error type of the data pipeline.

Every problem caused by the user's input (a missing file, a malformed line, a tokenizer that does
not fit the model) raises `DataError` with a one-line message that names the problem and the fix.
The CLI turns it into exit code 2 without a traceback, so the message must stand on its own.
"""


class DataError(ValueError):
    """Bad input to the data pipeline; the message says what is wrong and how to fix it."""
