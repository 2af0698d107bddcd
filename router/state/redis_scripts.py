"""Lua scripts the Redis backend runs (atomic, one round trip each)."""

from __future__ import annotations

__all__ = ["LEASE_ACQUIRE", "LEASE_RELEASE", "WRITE_BATCH"]

# One flushed batch, written atomically and at most once.
# KEYS[1] the writer's sequence key, KEYS[2] change stream, KEYS[3] registry hash,
# KEYS[4] counter-replicas set, KEYS[5] evictions stream, KEYS[6] hot-models set,
# KEYS[7..] counter hashes and hot-prefix sorted sets, referenced by position from ARGV.
# ARGV: seq, seq-ttl-s, origin, changes payload ('' if none), changes maxlen, evictions maxlen,
# then counted groups: registry ops (op, id, value), counters (key#, field, incr),
# counter replica ids, hot prefixes (key#, member, incr, model), evictions (replica, model,
# blocks, ts_ms).
# Why a sequence: a batch whose reply was lost (Redis stopped mid-call) is retried by the
# writer; the sequence makes that retry a no-op instead of counting everything twice.
WRITE_BATCH = """
local seq = tonumber(ARGV[1])
local last = tonumber(redis.call('GET', KEYS[1]) or '-1')
if last >= seq then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local origin = ARGV[3]
if ARGV[4] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'o', origin, 'd', ARGV[4])
end
local i = 7
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  if ARGV[i] == 'A' then
    redis.call('HSET', KEYS[3], ARGV[i + 1], ARGV[i + 2])
  else
    redis.call('HDEL', KEYS[3], ARGV[i + 1])
  end
  i = i + 3
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HINCRBY', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
  i = i + 3
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('SADD', KEYS[4], ARGV[i])
  i = i + 1
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('ZINCRBY', KEYS[tonumber(ARGV[i])], ARGV[i + 2], ARGV[i + 1])
  redis.call('SADD', KEYS[6], ARGV[i + 3])
  i = i + 4
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', 'replica', ARGV[i], 'model',
    ARGV[i + 1], 'blocks', ARGV[i + 2], 'origin', origin, 'ts_ms', ARGV[i + 3])
  i = i + 4
end
return 1
"""

# Take or renew the leader lease. KEYS[1] lease key; ARGV: instance id, ttl ms.
LEASE_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# Give the lease up on shutdown, only if still ours. KEYS[1] lease key; ARGV[1] instance id.
LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
