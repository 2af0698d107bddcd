# syntax=docker/dockerfile:1
# One slim, non-root image for both programs of this repo; the compose file / pod spec picks one:
#   command: ["fleet-router", "serve", ...]      the gateway (default)
#   command: ["fleet-replica", "--port", ...]    the simulated vLLM replica
# Real GPU replicas use the upstream vllm/vllm-openai image instead (see replicas/vllm/).

# --- build: install the package and its kv-events extra into a venv that the runtime stage copies ---
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for mypyc: the image runs the request hot path compiled (setup.py). Build stage only.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH="/opt/venv/bin:$PATH"
WORKDIR /src
# Metadata first, so a code-only change does not invalidate the dependency layer's cache key.
COPY pyproject.toml setup.py build_backend.py README.md ./
COPY router ./router
COPY replicas ./replicas
COPY loadtest ./loadtest
# Not editable: the runtime stage gets site-packages only, never the source tree.  Compiled: the
# hot path as C extension modules (FLEET_ROUTER_COMPILE=1; the log's "hot path compiled" says so).
RUN FLEET_ROUTER_COMPILE=1 pip install ".[kv-events]"

# --- runtime ---
FROM python:3.11-slim
ENV PATH="/opt/venv/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HEALTHCHECK_URL=http://127.0.0.1:8080/health
# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 fleet \
    && useradd --system --uid 10001 --gid fleet --no-create-home --shell /usr/sbin/nologin fleet
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /tmp
# 8080: the router; 8000: a replica's HTTP API; 5557: a replica's KV-events ZMQ publisher.
EXPOSE 8080 8000 5557
# The image has no curl; the stdlib does the probe. Replicas set HEALTHCHECK_URL to their own port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTHCHECK_URL'], timeout=2)"]
CMD ["fleet-router", "serve", "--port", "8080"]
