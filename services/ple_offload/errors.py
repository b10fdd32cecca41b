"""The PLE service's typed failures; messages are written for the operator who reads them."""

from __future__ import annotations


class PleError(Exception):
    """Base of every PLE offload failure."""


class TableFileError(PleError):
    """The table file is missing, truncated, or not the table that was asked for."""


class SegmentInUseError(PleError):
    """The shared-memory segment by that name belongs to a service that is still running."""


class TableClosedError(PleError):
    """The service that owned an attached table stopped or restarted; reattach."""


class TableUnavailableError(PleError):
    """No serving table could be reached (service down, loading, or gone for good)."""


class RowIdError(PleError, ValueError):
    """A lookup asked for a row id outside the table."""
