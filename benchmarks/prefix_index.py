"""Prefix index: decision time vs prompt length and index size, and bytes per indexed block.

A decision here is the router's whole per-request prefix work: routing key → chained block
hashes (`routing_key_hashes`), one index walk (`PrefixIndex.match`), and the kv_aware policy
over 4 candidates.  Prompts are text at 4 characters per token, cut into 64-character blocks.

    python benchmarks/prefix_index.py            # full run (index up to 1M blocks)
    python benchmarks/prefix_index.py --quick    # smaller index sizes

Memory is measured with tracemalloc around building the index, including the hash tuples the
index keeps alive, then divided by the number of trie nodes (blocks).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from router.policies.base import ReplicaView, RoutingRequest
from router.policies.kv_aware import KvAware
from router.prefix.index import IndexSettings, PrefixIndex
from router.prefix.keys import chain_seed, hash_text_blocks, routing_key_hashes

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REPLICAS = ("r0", "r1", "r2", "r3")
_ALPHABET = "abcdefghijklmnopqrstuvwxyz      "


def _text(rng: random.Random, chars: int) -> str:
    return "".join(rng.choices(_ALPHABET, k=chars))


def fill(index: PrefixIndex, blocks: int, rng: random.Random, prompt_chars: int = 32_768) -> None:
    """Insert distinct prompts (sharing a system prompt per group of 8) until `blocks` nodes."""
    seed = chain_seed(MODEL)
    systems = [_text(rng, 8_192) for _ in range(max(1, blocks // 4_000))]
    i = 0
    while index.blocks < blocks:
        text = systems[i % len(systems)] + _text(rng, prompt_chars - 8_192)
        index.insert(MODEL, tuple(hash_text_blocks(text, seed)), REPLICAS[i % len(REPLICAS)])
        i += 1


def decision_times_us(
    index: PrefixIndex, tokens: int, rng: random.Random, n: int, *, hit: bool
) -> list[float]:
    """Per-decision times; `hit`: the prompts are fully cached on all 4 replicas (the longest
    walk), else they share nothing with the index (the walk stops at once)."""
    policy = KvAware()
    bodies = [{"prompt": _text(rng, tokens * 4)} for _ in range(4)]
    if hit:
        seed = chain_seed(MODEL)
        for body in bodies:
            for r in REPLICAS:
                index.insert(MODEL, tuple(hash_text_blocks(body["prompt"], seed)), r)
    times: list[float] = []
    for k in range(n + 20):  # the first 20 warm up
        body = bodies[k % len(bodies)]
        t0 = time.perf_counter_ns()
        hashes, units = routing_key_hashes("completions", body, MODEL, 64)
        matches = index.match(MODEL, hashes)
        request = RoutingRequest(
            model=MODEL, block_hashes=hashes, prompt_units=units, prompt_tokens=units // 4
        )
        views = [
            ReplicaView(r, in_flight=k % 7, matched_blocks=matches.get(r, 0)) for r in REPLICAS
        ]
        policy.choose(request, views)
        if k >= 20:
            times.append((time.perf_counter_ns() - t0) / 1000)
    return times


def bytes_per_block(blocks: int) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(IndexSettings(default_capacity_blocks=blocks * 2, max_blocks=blocks * 2))
    fill(index, blocks, random.Random(7))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / index.blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="index sizes up to 100k blocks")
    parser.add_argument("--iterations", type=int, default=400)
    args = parser.parse_args()
    sizes = [0, 10_000, 100_000] if args.quick else [0, 10_000, 100_000, 1_000_000]
    rng = random.Random(1)
    print("decision time (hash + match + kv_aware over 4 replicas), microseconds")
    print(f"{'index blocks':>12} {'prompt tokens':>13} {'miss p50':>9} {'miss p99':>9}"
          f" {'hit p50':>8} {'hit p99':>8}")  # fmt: skip
    index = PrefixIndex(IndexSettings(default_capacity_blocks=10**7, max_blocks=10**7))
    for size in sizes:
        fill(index, size, rng)
        for tokens in (1_024, 8_192, 32_768):
            miss = statistics.quantiles(
                decision_times_us(index, tokens, rng, args.iterations, hit=False), n=100
            )
            hit = statistics.quantiles(
                decision_times_us(index, tokens, rng, args.iterations, hit=True), n=100
            )
            print(f"{size:>12,} {tokens:>13,} {miss[49]:>9.1f} {miss[98]:>9.1f}"
                  f" {hit[49]:>8.1f} {hit[98]:>8.1f}")  # fmt: skip
    size = 100_000 if args.quick else 1_000_000
    print(f"memory: {bytes_per_block(size):.0f} bytes per block ({size:,} blocks, tracemalloc)")


if __name__ == "__main__":
    main()
