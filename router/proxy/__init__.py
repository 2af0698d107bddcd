"""Forwarding to replicas: the upstream HTTP/1.1 pool (`upstream`), streaming passthrough with
retries before the first byte (`forward`), attempt deadlines (`deadlines`), headers, retry and
timeout settings.

Nothing is imported here: the fleet's scraper uses `router.proxy.upstream`, and `forward` uses
the routing core, which uses the fleet; an eager package would be a cycle.
"""
