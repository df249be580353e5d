-- kvgate's admission state in Redis: one script, so that every operation is atomic. The key
-- layout and the operations are documented in redis_store.py, which loads this file.
--
-- KEYS[1]  the key prefix (hash-tagged, so every key shares one cluster slot)
-- ARGV[1]  the operation; ARGV[2] now (unix ms); ARGV[3] how long an ended session is kept (ms)
-- ARGV[4]  the tiers, highest priority first, separated by spaces: the caller's vocabulary, so
--          that this script declares none of its own
-- ARGV[5]… the operation's own arguments, read with arg(1), arg(2), …
local P = KEYS[1]
local op = ARGV[1]
local now = tonumber(ARGV[2])
local retention = tonumber(ARGV[3])
local TIERS = {}
for t in string.gmatch(ARGV[4], '%S+') do TIERS[#TIERS + 1] = t end
local N = #TIERS
local BUCKET = 10000

local function arg(i) return ARGV[4 + i] end

local function skey(id) return P .. ':s:' .. id end

-- Tells the other front doors that a call slot ('call') or a whole session ('session') was
-- freed, for the calls they hold waiting for one; only for a session whose calls were ever
-- told 'busy' (its 'contended' field), so that uncontended sessions cost no message, and for
-- a session closed by another front door than the one that admitted it (its 'origin'), which
-- follows it until it ends.
local function announce(kind, id, origin)
  local f = redis.call('HMGET', skey(id), 'contended', 'origin')
  if f[1] or (kind == 'session' and f[2] and f[2] ~= origin) then
    redis.call('PUBLISH', P .. ':freed', kind .. ' ' .. origin .. ' ' .. id)
  end
end

local function end_lease(id, state)
  local lease = redis.call('HGET', P .. ':leases', id)
  if not lease then return 0 end
  local tier, tenant, tokens, parallel = string.match(lease, '^(%S+) (%S+) (%S+) (%S+)$')
  tokens = tonumber(tokens)
  redis.call('HINCRBY', P .. ':totals', 'tier:' .. tier, -tokens)
  redis.call('HINCRBY', P .. ':totals', 'sessions:' .. tenant, -1)
  redis.call('HINCRBY', P .. ':totals', 'parallel:' .. tenant, -tonumber(parallel))
  redis.call('HINCRBY', P .. ':totals', 'tokens:' .. tenant, -tokens)
  redis.call('HINCRBY', P .. ':totals', 'active:' .. tier .. ':' .. tenant, -1)
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
  -- Answers each tier's reserved tokens, then the tenant's sessions, parallel calls and
  -- tokens this minute, then the tokens released over the last buckets.
  local tenant, window = arg(1), arg(2)
  local out = {}
  for i, t in ipairs(TIERS) do out[i] = total('tier:' .. t) end
  out[N + 1] = total('sessions:' .. tenant)
  out[N + 2] = total('parallel:' .. tenant)
  out[N + 3] = tonumber(redis.call('GET', P .. ':tpm:' .. tenant .. ':' .. window) or '0')
  local released = 0
  local bucket = math.floor(now / BUCKET)
  for i = 0, tonumber(arg(3)) - 1 do
    released = released + tonumber(redis.call('GET', P .. ':released:' .. (bucket - i)) or '0')
  end
  out[N + 4] = released
  return out
elseif op == 'reserve' then
  -- The tier is an index into TIERS; the limits, one per tier in the same order, bound the
  -- tokens held by that tier and every tier below it (the nested shares).
  local id, tenant, tier_index = arg(1), arg(2), tonumber(arg(3))
  local tokens, parallel = tonumber(arg(4)), tonumber(arg(5))
  local expires, deadline = tonumber(arg(6)), tonumber(arg(7))
  local max_sessions, max_parallel = tonumber(arg(8)), tonumber(arg(9))
  local tpm_limit, tpm_charge, window = tonumber(arg(10)), tonumber(arg(11)), arg(12)
  local idem, idem_ttl = arg(13), tonumber(arg(14))
  local fields = cjson.decode(arg(15))
  local max_reserved = tonumber(arg(16))  -- the tenant's reserved tokens; -1: no limit
  local limits = {}
  for i = 1, N do limits[i] = tonumber(arg(16 + i)) end
  local idem_key = P .. ':idem:' .. tenant .. ':' .. idem
  if idem ~= '' then
    local known = redis.call('GET', idem_key)
    if known and redis.call('EXISTS', skey(known)) == 1 then return {'existing', known} end
  end
  local held = {}
  for i, t in ipairs(TIERS) do held[i] = total('tier:' .. t) end
  for i = tier_index, 1, -1 do
    local group = tokens
    for j = i, N do group = group + held[j] end
    if group > limits[i] then
      local reason = 'tier_capacity'
      if i == 1 then reason = 'fleet_saturated' end
      return {reason, tostring(group - limits[i])}
    end
  end
  local tpm_key = P .. ':tpm:' .. tenant .. ':' .. window
  if total('sessions:' .. tenant) + 1 > max_sessions
      or total('parallel:' .. tenant) + parallel > max_parallel
      or tonumber(redis.call('GET', tpm_key) or '0') + tpm_charge > tpm_limit
      or (max_reserved >= 0 and total('tokens:' .. tenant) + tokens > max_reserved) then
    return {'tenant_quota', '0'}
  end
  local tier = TIERS[tier_index]
  redis.call('HINCRBY', P .. ':totals', 'tier:' .. tier, tokens)
  redis.call('HINCRBY', P .. ':totals', 'sessions:' .. tenant, 1)
  redis.call('HINCRBY', P .. ':totals', 'parallel:' .. tenant, parallel)
  redis.call('HINCRBY', P .. ':totals', 'tokens:' .. tenant, tokens)
  redis.call('HINCRBY', P .. ':totals', 'active:' .. tier .. ':' .. tenant, 1)
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
  return redis.call('HGETALL', skey(arg(1)))
elseif op == 'release' then
  if end_lease(arg(1), arg(2)) == 1 then announce('session', arg(1), arg(3)) end
  return redis.call('HGETALL', skey(arg(1)))
elseif op == 'acquire' then
  -- Answers the status followed by the session's fields, so the caller needs no second call.
  -- The call's charge (CallCharge in state.py): its tokens, the most the session's calls in
  -- flight may weigh together, and the tenant's tokens per minute for what passes the
  -- session's declaration.
  local id, call_id, call_deadline = arg(1), arg(2), tonumber(arg(3))
  local tokens, in_flight_limit = tonumber(arg(4)), tonumber(arg(5))
  local tpm_limit, window = tonumber(arg(6)), arg(7)
  local k = skey(id)
  if redis.call('EXISTS', k) == 0 then return {'not_found'} end
  local function answer(status)
    local out = redis.call('HGETALL', k)
    table.insert(out, 1, status)
    return out
  end
  local f = redis.call('HMGET', k, 'state', 'max_parallel', 'deadline_ms', 'expires_ms',
    'tokens_used', 'expected_calls', 'est_prompt_tokens', 'est_output_tokens', 'tenant')
  if f[1] ~= 'active' then return answer(f[1]) end
  local slots = P .. ':slots:' .. id
  local weights = P .. ':weights:' .. id
  local gone = redis.call('ZRANGEBYSCORE', slots, '-inf', now)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
    redis.call('HDEL', weights, unpack(gone))
  end
  local in_flight = 0
  for _, w in ipairs(redis.call('HVALS', weights)) do in_flight = in_flight + tonumber(w) end
  if redis.call('ZCARD', slots) >= tonumber(f[2]) or in_flight + tokens > in_flight_limit then
    redis.call('HSET', k, 'contended', '1')
    return answer('busy')
  end
  local used = tonumber(f[5] or '0')
  local declared = tonumber(f[6]) * (tonumber(f[7]) + tonumber(f[8]))
  local excess = math.max(0, used + tokens - declared) - math.max(0, used - declared)
  if excess > 0 then
    local tpm_key = P .. ':tpm:' .. f[9] .. ':' .. window
    if tonumber(redis.call('GET', tpm_key) or '0') + excess > tpm_limit then
      return answer('over_quota')
    end
    redis.call('INCRBY', tpm_key, excess)
    redis.call('PEXPIRE', tpm_key, 120000)
  end
  redis.call('ZADD', slots, call_deadline, call_id)
  redis.call('HSET', weights, call_id, tokens)
  local deadline = tonumber(f[3])
  redis.call('PEXPIRE', slots, deadline - now + 60000)
  redis.call('PEXPIRE', weights, deadline - now + 60000)
  local expires = math.min(deadline, math.max(tonumber(f[4]), call_deadline))
  redis.call('HSET', k, 'expires_ms', expires, 'tokens_used', used + tokens)
  redis.call('HINCRBY', k, 'calls_started', 1)
  redis.call('ZADD', P .. ':expiry', 'XX', expires, id)
  return answer('acquired')
elseif op == 'release_call' then
  local id, call_id = arg(1), arg(2)
  local slots = P .. ':slots:' .. id
  redis.call('HDEL', P .. ':weights:' .. id, call_id)
  if redis.call('ZREM', slots, call_id) == 1 then announce('call', id, arg(3)) end
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
  local id = arg(1)
  if not redis.call('HGET', P .. ':leases', id) then return 0 end
  local k = skey(id)
  local f = redis.call('HMGET', k, 'deadline_ms', 'idle_timeout_ms', 'expires_ms')
  local expires = math.min(tonumber(f[1]), math.max(tonumber(f[3]), now + tonumber(f[2])))
  redis.call('HSET', k, 'expires_ms', expires)
  redis.call('ZADD', P .. ':expiry', 'XX', expires, id)
  return 1
elseif op == 'heal' then
  -- The totals recomputed from the leases, the source of truth; a lease that lost its expiry
  -- entry gets its session's expiry back (now, if its session's hash is lost too, so that it
  -- ends); an expiry entry whose lease is lost is dropped. Answers how many entries were wrong.
  local wrong = 0
  local want = {}
  local function add(field, n) want[field] = (want[field] or 0) + n end
  local leases = redis.call('HGETALL', P .. ':leases')
  for i = 1, #leases, 2 do
    local id = leases[i]
    local tier, tenant, tokens, parallel = string.match(leases[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
    add('tier:' .. tier, tonumber(tokens))
    add('sessions:' .. tenant, 1)
    add('parallel:' .. tenant, tonumber(parallel))
    add('tokens:' .. tenant, tonumber(tokens))
    add('active:' .. tier .. ':' .. tenant, 1)
    if not redis.call('ZSCORE', P .. ':expiry', id) then
      local expires = redis.call('HGET', skey(id), 'expires_ms') or now
      redis.call('ZADD', P .. ':expiry', tonumber(expires), id)
      wrong = wrong + 1
    end
  end
  for _, id in ipairs(redis.call('ZRANGE', P .. ':expiry', 0, -1)) do
    if redis.call('HEXISTS', P .. ':leases', id) == 0 then
      redis.call('ZREM', P .. ':expiry', id)
      wrong = wrong + 1
    end
  end
  local have = redis.call('HGETALL', P .. ':totals')
  for i = 1, #have, 2 do
    local field, value = have[i], tonumber(have[i + 1])
    local right = want[field] or 0
    want[field] = nil
    if value ~= right then
      wrong = wrong + 1
      if right == 0 then
        redis.call('HDEL', P .. ':totals', field)
      else
        redis.call('HSET', P .. ':totals', field, right)
      end
    elseif right == 0 then
      redis.call('HDEL', P .. ':totals', field)  -- a tenant long gone: nothing to keep
    end
  end
  for field, right in pairs(want) do
    redis.call('HSET', P .. ':totals', field, right)
    wrong = wrong + 1
  end
  return wrong
elseif op == 'active' then
  -- Live sessions per tier and tenant: tier, tenant, count, ... (counts above zero only).
  local out = {}
  local have = redis.call('HGETALL', P .. ':totals')
  for i = 1, #have, 2 do
    local tier, tenant = string.match(have[i], '^active:([^:]+):(.+)$')
    if tier and tonumber(have[i + 1]) > 0 then
      out[#out + 1] = tier
      out[#out + 1] = tenant
      out[#out + 1] = have[i + 1]
    end
  end
  return out
elseif op == 'reserved' then
  local sum = 0
  for _, t in ipairs(TIERS) do sum = sum + total('tier:' .. t) end
  return sum
end
return redis.error_reply('unknown op ' .. op)
