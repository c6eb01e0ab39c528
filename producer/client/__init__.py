"""The Python client: submit requests, wait for their results, cancel them, ask where they are, read queue
stats; blocking (``Client``) or asyncio (``AsyncClient``), with the same methods (docs/CLIENT.md).

plans.py (every Redis exchange planned, no socket: ``Producer``, ``prepare``; a wait with no live worker)
steps.py (what a plan yields)  runner.py (a plan run on a connection)  faces.py (``Client``, ``AsyncClient``)
arrivals.py (results as they land)  control.py (cancel, status)  stats.py  served.py (which models live
workers serve, where). Every error the client raises is here too.
"""

from ..plumbing.connection import aconnect, connect
from ..plumbing.supported import UnsupportedServer
from ..wire.errors import (DecisionQueueError, InvalidRequest, LibraryUnavailable, ModelNotServed, NotDurable,
                           QueueFull, RedisUnreachable, ResultTimeout, WrongResult)
from ..wire.records import Cancel, Status
from ..wire.result import Result, ResultError
from .faces import AsyncClient, Client
from .plans import Prepared, prepare

__all__ = ["AsyncClient", "Cancel", "Client", "DecisionQueueError", "InvalidRequest", "LibraryUnavailable",
           "ModelNotServed", "NotDurable", "Prepared", "QueueFull", "RedisUnreachable", "Result", "ResultError",
           "ResultTimeout", "Status", "UnsupportedServer", "WrongResult", "aconnect", "connect", "prepare"]
