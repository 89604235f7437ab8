"""Errors of the Swarm commands: each says what is wrong and what to do about it."""

from __future__ import annotations

from ..errors import SwarmfdError


class SwarmJobError(SwarmfdError, RuntimeError):
    """A job cannot be created, found or removed (the message says what to do)."""


class JobNotFoundError(SwarmJobError, LookupError):
    """No job of that name exists (no service, network or secret carries its label)."""


class EngineUnavailableError(SwarmJobError, ConnectionError):
    """No Docker engine answers at the given host, or it is not a usable Swarm manager."""
