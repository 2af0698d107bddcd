"""Prompt prefixes: routing keys and block hashes, the prefix index, and exact mode (KV events).

- `router.prefix.keys`: request body → chained block hashes (`routing_key_hashes`).
- `router.prefix.index`: `PrefixIndex`, one pygtrie trie per model, per-replica LRU capacity.
- `router.prefix.units`: `KeyUnits`, vLLM capacity in index blocks, blocks ↔ tokens.
- `router.prefix.tokenizer`: the tokenizer of token mode (`load_routing_tokenizer`).
- exact mode: `kv_decode` (vLLM event batches, both encodings), `exact` (`ExactIndexer`: engine
  hash → own hash, events → index), `kv_events` (`KvEventConsumer`: ZMQ SUB, gaps, replay),
  `kv_spec` (the `--kv-events` setting).

docs/routing.md describes all of it.
"""

from router.prefix.index import IndexSettings, IndexStats, PrefixIndex
from router.prefix.keys import routing_key_hashes
from router.prefix.units import KeyUnits

__all__ = ["IndexSettings", "IndexStats", "KeyUnits", "PrefixIndex", "routing_key_hashes"]
