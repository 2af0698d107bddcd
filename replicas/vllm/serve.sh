#!/usr/bin/env bash
# Launch one real vLLM replica with the flags fleet-router relies on (see README.md beside this file).
#
#   replicas/vllm/serve.sh [MODEL] [extra vllm flags ...]
#
# Environment (all optional):
#   MODEL                   model to serve                 (default meta-llama/Llama-3.1-8B-Instruct)
#   PORT                    OpenAI-compatible HTTP port     (default 8000)
#   KV_EVENTS_PORT          ZMQ PUB port for KV-cache events (default 5557)
#   MAX_NUM_BATCHED_TOKENS  per-step token budget          (default 8192, H100/H200-class)
#   MAX_NUM_SEQS            max running sequences           (default 256)
# Extra arguments are passed to `vllm serve` unchanged (e.g. --tensor-parallel-size 2).
set -euo pipefail

MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    MODEL="$1"
    shift
fi
PORT="${PORT:-8000}"
KV_EVENTS_PORT="${KV_EVENTS_PORT:-5557}"

# KV-cache events let the router track each replica's cache exactly (BlockStored/BlockRemoved)
# instead of predicting it; they go out on a ZMQ PUB socket under the topic "kv-events".
KV_EVENTS_CONFIG="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:${KV_EVENTS_PORT}\", \"topic\": \"kv-events\"}"

# --enable-prefix-caching: reuse cached prefix blocks (what the router routes for).
# --enable-chunked-prefill + --max-num-batched-tokens: long prompts ride along with decode steps.
# --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in every response,
#   so clients (and the load tester) see per-request cache hits.
exec vllm serve "$MODEL" \
    --port "$PORT" \
    --enable-prefix-caching \
    --enable-chunked-prefill \
    --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-8192}" \
    --max-num-seqs "${MAX_NUM_SEQS:-256}" \
    --enable-prompt-tokens-details \
    --kv-events-config "$KV_EVENTS_CONFIG" \
    "$@"
