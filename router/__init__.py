"""fleet-router: a cache-aware, OpenAI-compatible router for fleets of LLM inference replicas."""

__version__ = "0.1.0"
