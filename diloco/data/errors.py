"""The one error type of the data layer: bad input that names the file and what is wrong."""


class DataError(ValueError):
    """A data source, corpus or batch request cannot be served; the message says which and why."""
