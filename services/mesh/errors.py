"""Errors every service can raise while it starts, which the CLI reports in one line."""


class ServiceStartError(RuntimeError):
    """A service cannot start (its port is taken, say); the message says what to change."""
