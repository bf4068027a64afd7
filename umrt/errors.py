"""Errors umrt raises on purpose.

Every error a user can cause (a bad file, a bad flag, a bad env var) is a
:class:`UmrtError`; the CLI prints its message and exits with ``exit_code``
instead of showing a traceback.
"""
from __future__ import annotations


class UmrtError(Exception):
    """A user-facing error with a clear message and a CLI exit status."""

    exit_code = 2


class TraceFormatError(UmrtError):
    """A trace file is missing, truncated, corrupt, or of an unknown version."""


class ConfigError(UmrtError):
    """A UMRT_* variable, CLI flag or profile file holds an invalid value."""


class DataIntegrityError(UmrtError):
    """Live data was read after it had been discarded, or read before being written.

    The simulator raises this: it is how umrt proves a policy loses nothing.
    """

    exit_code = 3


class CudaError(UmrtError):
    """A CUDA runtime call failed; the message names the call."""

    exit_code = 1


class StoppedActing(UmrtError):
    """umrt's runtime stopped acting after an error (``UMRT_STRICT=1`` raises this).

    The original error is the ``__cause__``. Raised in the training program's
    thread at a safe point (see :class:`umrt.drive.live.LiveBridge`), never from
    inside torch's allocator.
    """

    exit_code = 1
