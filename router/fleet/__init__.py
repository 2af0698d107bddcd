"""The fleet: replicas, their health, circuit state, load and scraped vLLM metrics."""

from router.fleet.circuit import CircuitBreaker, CircuitState
from router.fleet.health import HealthChecker, fetch_models
from router.fleet.registry import Fleet, FleetObserver
from router.fleet.replica import Replica
from router.fleet.scraper import MetricsScraper
from router.fleet.stats import ScrapedStats, parse_vllm_metrics

__all__ = [
    "CircuitBreaker",
    "CircuitState",
    "Fleet",
    "FleetObserver",
    "HealthChecker",
    "MetricsScraper",
    "Replica",
    "ScrapedStats",
    "fetch_models",
    "parse_vllm_metrics",
]
