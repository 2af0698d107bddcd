"""Forwarding to replicas: streaming passthrough, retries before the first byte, timeouts."""

from router.proxy.forward import Outcome, Proxy, new_request_id
from router.proxy.headers import REPLICA_HEADER, REQUEST_ID_HEADER
from router.proxy.retry import ExponentialBackoff, RetryPolicy, Timeouts

__all__ = [
    "REPLICA_HEADER",
    "REQUEST_ID_HEADER",
    "ExponentialBackoff",
    "Outcome",
    "Proxy",
    "RetryPolicy",
    "Timeouts",
    "new_request_id",
]
