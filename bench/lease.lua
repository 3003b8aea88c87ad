-- wrk script for `fence server`. Arguments: MODE PREFIX CLIENTS.
-- claim: every request claims a job never claimed before ("PREFIX-<thread>-<n>"), so each is
--        a new lease: one durable write, like an etcd lease grant.
-- renew: requests renew the jobs "PREFIX-0" .. "PREFIX-<CLIENTS-1>", claimed beforehand by
--        owner "o" with lease key KEY (generation 1); thread k takes the jobs j with
--        j mod threads == k.
-- checkpoint: as renew, but each request saves a checkpoint of SIZE bytes (a fourth argument,
--        default 64) under the same leases (contract section 14).
-- Every body carries the lease key KEY (contract v2 section 4).
local threads = {}
local KEY = "benchkey-0123456789abcdef"

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
  thread:set("nthreads", 0)
  for _, t in ipairs(threads) do t:set("nthreads", #threads) end
end

function init(args)
  mode, prefix, clients = args[1], args[2], tonumber(args[3] or "1")
  data = string.rep("x", tonumber(args[4] or "64"))
  n = 0
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  mine = {}
  for j = 0, clients - 1 do
    if j % nthreads == id then table.insert(mine, j) end
  end
  if #mine == 0 then mine = { id } end
end

function request()
  n = n + 1
  if mode == "claim" then
    return wrk.format(nil, "/v1/leases/" .. prefix .. "-" .. id .. "-" .. n .. "/claim", nil,
      '{"owner":"o' .. id .. '","lease_key":"' .. KEY .. '","ttl_ms":30000}')
  end
  local j = mine[(n % #mine) + 1]
  if mode == "checkpoint" then
    return wrk.format(nil, "/v1/leases/" .. prefix .. "-" .. j .. "/checkpoint", nil,
      '{"owner":"o","generation":1,"lease_key":"' .. KEY .. '","checkpoint":"' .. data .. '"}')
  end
  return wrk.format(nil, "/v1/leases/" .. prefix .. "-" .. j .. "/renew", nil,
    '{"owner":"o","generation":1,"lease_key":"' .. KEY .. '","ttl_ms":30000}')
end
