"""Admission state in Redis, shared by every front-door replica.

Every operation is one Lua script call, so it is atomic: it first sweeps expired leases (any
replica's traffic releases a dead replica's sessions), then reads or changes the state. Keys,
all under one hash-tagged prefix (``{kvgate}`` by default) so that they share a cluster slot:

- ``P:s:<id>``          session hash; TTL = until its deadline plus the retention time
- ``P:leases``          hash id -> "tier tenant tokens parallel" for every live reservation
- ``P:expiry``          sorted set id -> lease expiry (ms); what the sweep reads
- ``P:totals``          hash: ``tier:<tier>`` tokens, ``sessions:<tenant>``, ``parallel:<tenant>``
- ``P:slots:<id>``      sorted set call id -> call deadline (the session's calls in flight)
- ``P:released:<b>``    tokens released in 10 s bucket ``b`` (TTL 80 s)
- ``P:tpm:<tenant>:<m>`` tokens charged in minute ``m`` (TTL 2 min)
- ``P:idem:<tenant>:<key>`` session id of an idempotent create (TTL 24 h)

A lease lives in ``P:leases``/``P:expiry`` (no TTL: they are removed exactly when the lease
ends, so totals never drift), while everything else carries a TTL, so nothing outlives its use.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from broker.admission import Holdings
from broker.admission_state import (
    DEFAULT_RETENTION_MS,
    RELEASE_BUCKET_MS,
    RELEASE_WINDOW_BUCKETS,
    ReserveOutcome,
    ReserveRequest,
    SessionRecord,
    SlotStatus,
    minute_window,
)
from broker.errors import AdmissionUnavailable
from schemas.vocab import TIERS_BY_PRIORITY, Reason, SessionState, Tier

IDEMPOTENCY_TTL_MS = 24 * 3_600_000

_SCRIPT = """
local P = KEYS[1]
local op = ARGV[1]
local now = tonumber(ARGV[2])
local retention = tonumber(ARGV[3])
local TIERS = {'guaranteed', 'standard', 'besteffort'}
local BUCKET = 10000

local function skey(id) return P .. ':s:' .. id end

local function end_lease(id, state)
  local lease = redis.call('HGET', P .. ':leases', id)
  if not lease then return 0 end
  local tier, tenant, tokens, parallel = string.match(lease, '^(%S+) (%S+) (%S+) (%S+)$')
  tokens = tonumber(tokens)
  redis.call('HINCRBY', P .. ':totals', 'tier:' .. tier, -tokens)
  redis.call('HINCRBY', P .. ':totals', 'sessions:' .. tenant, -1)
  redis.call('HINCRBY', P .. ':totals', 'parallel:' .. tenant, -tonumber(parallel))
  redis.call('HDEL', P .. ':leases', id)
  redis.call('ZREM', P .. ':expiry', id)
  local b = P .. ':released:' .. math.floor(now / BUCKET)
  redis.call('INCRBY', b, tokens)
  redis.call('PEXPIRE', b, BUCKET * 8)
  local k = skey(id)
  if redis.call('EXISTS', k) == 1 then
    redis.call('HSET', k, 'state', state, 'ended_ms', now)
    redis.call('PEXPIRE', k, retention)
  end
  return 1
end

local function sweep()
  local ids = redis.call('ZRANGEBYSCORE', P .. ':expiry', '-inf', now, 'LIMIT', 0, 256)
  for _, id in ipairs(ids) do end_lease(id, 'expired') end
  return #ids
end

local function total(field)
  return tonumber(redis.call('HGET', P .. ':totals', field) or '0')
end

local swept = sweep()

if op == 'sweep' then
  return swept
elseif op == 'holdings' then
  local tenant, window = ARGV[4], ARGV[5]
  local out = {}
  for i, t in ipairs(TIERS) do out[i] = total('tier:' .. t) end
  out[4] = total('sessions:' .. tenant)
  out[5] = total('parallel:' .. tenant)
  out[6] = tonumber(redis.call('GET', P .. ':tpm:' .. tenant .. ':' .. window) or '0')
  local released = 0
  local bucket = math.floor(now / BUCKET)
  for i = 0, tonumber(ARGV[6]) - 1 do
    released = released + tonumber(redis.call('GET', P .. ':released:' .. (bucket - i)) or '0')
  end
  out[7] = released
  return out
elseif op == 'reserve' then
  local id, tenant, tier_index = ARGV[4], ARGV[5], tonumber(ARGV[6])
  local tokens, parallel = tonumber(ARGV[7]), tonumber(ARGV[8])
  local expires, deadline = tonumber(ARGV[9]), tonumber(ARGV[10])
  local limits = {tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])}
  local max_sessions, max_parallel = tonumber(ARGV[14]), tonumber(ARGV[15])
  local tpm_limit, tpm_charge, window = tonumber(ARGV[16]), tonumber(ARGV[17]), ARGV[18]
  local idem, idem_ttl = ARGV[19], tonumber(ARGV[20])
  local fields = cjson.decode(ARGV[21])
  local idem_key = P .. ':idem:' .. tenant .. ':' .. idem
  if idem ~= '' then
    local known = redis.call('GET', idem_key)
    if known and redis.call('EXISTS', skey(known)) == 1 then return {'existing', known} end
  end
  local held = {}
  for i, t in ipairs(TIERS) do held[i] = total('tier:' .. t) end
  for i = tier_index, 1, -1 do
    local group = tokens
    for j = i, 3 do group = group + held[j] end
    if group > limits[i] then
      local reason = 'tier_capacity'
      if i == 1 then reason = 'fleet_saturated' end
      return {reason, tostring(group - limits[i])}
    end
  end
  local tpm_key = P .. ':tpm:' .. tenant .. ':' .. window
  if total('sessions:' .. tenant) + 1 > max_sessions
      or total('parallel:' .. tenant) + parallel > max_parallel
      or tonumber(redis.call('GET', tpm_key) or '0') + tpm_charge > tpm_limit then
    return {'tenant_quota', '0'}
  end
  local tier = TIERS[tier_index]
  redis.call('HINCRBY', P .. ':totals', 'tier:' .. tier, tokens)
  redis.call('HINCRBY', P .. ':totals', 'sessions:' .. tenant, 1)
  redis.call('HINCRBY', P .. ':totals', 'parallel:' .. tenant, parallel)
  redis.call('INCRBY', tpm_key, tpm_charge)
  redis.call('PEXPIRE', tpm_key, 120000)
  redis.call('HSET', P .. ':leases', id,
    tier .. ' ' .. tenant .. ' ' .. tokens .. ' ' .. parallel)
  redis.call('ZADD', P .. ':expiry', expires, id)
  local k = skey(id)
  for name, value in pairs(fields) do redis.call('HSET', k, name, value) end
  redis.call('PEXPIRE', k, deadline - now + retention)
  if idem ~= '' then redis.call('SET', idem_key, id, 'PX', idem_ttl) end
  return {'admitted', id}
elseif op == 'get' then
  return redis.call('HGETALL', skey(ARGV[4]))
elseif op == 'release' then
  end_lease(ARGV[4], ARGV[5])
  return redis.call('HGETALL', skey(ARGV[4]))
elseif op == 'acquire' then
  -- Answers the status followed by the session's fields, so the caller needs no second call.
  local id, call_id, call_deadline = ARGV[4], ARGV[5], tonumber(ARGV[6])
  local k = skey(id)
  if redis.call('EXISTS', k) == 0 then return {'not_found'} end
  local function answer(status)
    local out = redis.call('HGETALL', k)
    table.insert(out, 1, status)
    return out
  end
  local f = redis.call('HMGET', k, 'state', 'max_parallel', 'deadline_ms', 'expires_ms')
  if f[1] ~= 'active' then return answer(f[1]) end
  local slots = P .. ':slots:' .. id
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  if redis.call('ZCARD', slots) >= tonumber(f[2]) then return answer('busy') end
  redis.call('ZADD', slots, call_deadline, call_id)
  local deadline = tonumber(f[3])
  redis.call('PEXPIRE', slots, deadline - now + 60000)
  local expires = math.min(deadline, math.max(tonumber(f[4]), call_deadline))
  redis.call('HSET', k, 'expires_ms', expires)
  redis.call('HINCRBY', k, 'calls_started', 1)
  redis.call('ZADD', P .. ':expiry', 'XX', expires, id)
  return answer('acquired')
elseif op == 'release_call' then
  local id, call_id = ARGV[4], ARGV[5]
  local slots = P .. ':slots:' .. id
  redis.call('ZREM', slots, call_id)
  if not redis.call('HGET', P .. ':leases', id) then return 0 end
  local k = skey(id)
  local f = redis.call('HMGET', k, 'deadline_ms', 'idle_timeout_ms')
  local busy = redis.call('ZRANGE', slots, -1, -1, 'WITHSCORES')
  local idle_from = now + tonumber(f[2])
  if busy[2] then idle_from = math.max(idle_from, tonumber(busy[2])) end
  local expires = math.min(tonumber(f[1]), idle_from)
  redis.call('HSET', k, 'expires_ms', expires)
  redis.call('ZADD', P .. ':expiry', 'XX', expires, id)
  return 1
elseif op == 'touch' then
  local id = ARGV[4]
  if not redis.call('HGET', P .. ':leases', id) then return 0 end
  local k = skey(id)
  local f = redis.call('HMGET', k, 'deadline_ms', 'idle_timeout_ms', 'expires_ms')
  local expires = math.min(tonumber(f[1]), math.max(tonumber(f[3]), now + tonumber(f[2])))
  redis.call('HSET', k, 'expires_ms', expires)
  redis.call('ZADD', P .. ':expiry', 'XX', expires, id)
  return 1
elseif op == 'reserved' then
  local sum = 0
  for _, t in ipairs(TIERS) do sum = sum + total('tier:' .. t) end
  return sum
end
return redis.error_reply('unknown op ' .. op)
"""

_INT_FIELDS = (
    "max_parallel",
    "expected_calls",
    "est_prompt_tokens",
    "est_output_tokens",
    "reserved_tokens",
    "created_ms",
    "deadline_ms",
    "idle_timeout_ms",
    "expires_ms",
    "calls_started",
)


class RedisAdmissionState:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "{kvgate}",
        retention_ms: int = DEFAULT_RETENTION_MS,
        timeout_s: float = 0.5,
    ) -> None:
        self.prefix = prefix
        self.retention_ms = retention_ms
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            retry_on_timeout=False,
        )
        self._script = self._redis.register_script(_SCRIPT)

    async def _call(self, op: str, now_ms: int, *args: str | int) -> Any:
        try:
            return await self._script(
                keys=[self.prefix], args=[op, now_ms, self.retention_ms, *args]
            )
        except (RedisError, OSError) as exc:
            raise AdmissionUnavailable(f"admission state (Redis) unavailable: {exc}") from exc

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def holdings(self, tenant: str, now_ms: int) -> Holdings:
        window, left_s = minute_window(now_ms)
        out = await self._call("holdings", now_ms, tenant, window, RELEASE_WINDOW_BUCKETS)
        window_s = RELEASE_BUCKET_MS * RELEASE_WINDOW_BUCKETS / 1000
        return Holdings(
            reserved_by_tier={t: int(out[i]) for i, t in enumerate(TIERS_BY_PRIORITY)},
            tenant_sessions=int(out[3]),
            tenant_parallel=int(out[4]),
            tenant_tokens_this_minute=int(out[5]),
            released_tokens_per_s=int(out[6]) / window_s,
            seconds_to_next_minute=left_s,
        )

    async def reserve(self, request: ReserveRequest, now_ms: int) -> ReserveOutcome:
        record = request.record
        limits = request.tenant_limits
        window, _ = minute_window(now_ms)
        out = await self._call(
            "reserve",
            now_ms,
            record.id,
            record.tenant,
            TIERS_BY_PRIORITY.index(record.tier) + 1,
            record.reserved_tokens,
            record.max_parallel,
            record.expires_ms,
            record.deadline_ms,
            *request.tier_limits,
            limits.max_sessions,
            limits.max_parallel_calls,
            limits.tokens_per_minute,
            request.tokens_charged,
            window,
            request.idempotency_key or "",
            IDEMPOTENCY_TTL_MS,
            json.dumps(_to_fields(record)),
        )
        status, value = out[0], out[1]
        if status == "admitted":
            return ReserveOutcome(Reason.ADMITTED, record)
        if status == "existing":
            existing = await self.get(value, now_ms)
            if existing is not None:
                return ReserveOutcome(Reason.ADMITTED, existing, existing=True)
            return ReserveOutcome(Reason.FLEET_SATURATED)
        return ReserveOutcome(Reason(status), shortfall_tokens=int(value))

    async def get(self, session_id: str, now_ms: int) -> SessionRecord | None:
        return _from_fields(await self._call("get", now_ms, session_id))

    async def release(
        self, session_id: str, state: SessionState, now_ms: int
    ) -> SessionRecord | None:
        return _from_fields(await self._call("release", now_ms, session_id, state.value))

    async def acquire_call(
        self, session_id: str, call_id: str, call_deadline_ms: int, now_ms: int
    ) -> tuple[SlotStatus, SessionRecord | None]:
        out = await self._call("acquire", now_ms, session_id, call_id, call_deadline_ms)
        return SlotStatus(out[0]), _from_fields(out[1:])

    async def release_call(self, session_id: str, call_id: str, now_ms: int) -> None:
        await self._call("release_call", now_ms, session_id, call_id)

    async def touch(self, session_id: str, now_ms: int) -> None:
        await self._call("touch", now_ms, session_id)

    async def sweep(self, now_ms: int) -> int:
        return int(await self._call("sweep", now_ms))

    async def reserved_tokens(self) -> int:
        return int(await self._call("reserved", 0))

    async def delete_all(self) -> None:
        """Remove every key under the prefix (tests and ``kvgate`` resets)."""
        async for key in self._redis.scan_iter(match=f"{self.prefix}*", count=500):
            await self._redis.delete(key)

    async def close(self) -> None:
        await self._redis.aclose()


def _to_fields(record: SessionRecord) -> dict[str, str]:
    # Strings only: Lua numbers are doubles and would print large integers in exponent form.
    fields = {name: str(getattr(record, name)) for name in _INT_FIELDS}
    fields.update(
        id=record.id,
        tenant=record.tenant,
        tier=record.tier.value,
        state=record.state.value,
        metadata=json.dumps(record.metadata),
    )
    return fields


def _from_fields(flat: list[str]) -> SessionRecord | None:
    if not flat:
        return None
    raw = dict(zip(flat[::2], flat[1::2], strict=True))
    ended = raw.get("ended_ms")
    return SessionRecord(
        id=raw["id"],
        tenant=raw["tenant"],
        tier=Tier(raw["tier"]),
        state=SessionState(raw["state"]),
        ended_ms=None if ended is None else int(ended),
        metadata=json.loads(raw.get("metadata", "{}")),
        **{name: int(raw[name]) for name in _INT_FIELDS},
    )
