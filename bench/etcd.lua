-- wrk script for etcd's HTTP gateway (v3 API). Arguments: MODE [LEASE_ID ...].
-- grant: every request grants a new 30 s lease (a raft proposal, on disk before the answer).
-- keepalive: requests keep the given leases alive, round robin per thread over the ids j
--            with j mod threads == thread.
local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
  for _, t in ipairs(threads) do t:set("nthreads", #threads) end
end

function init(args)
  mode = args[1]
  n = 0
  wrk.method = "POST"
  mine = {}
  for j = 2, #args do
    if (j - 2) % nthreads == id then table.insert(mine, args[j]) end
  end
end

function request()
  n = n + 1
  if mode == "grant" then
    return wrk.format(nil, "/v3/lease/grant", nil, '{"TTL":30}')
  end
  return wrk.format(nil, "/v3/lease/keepalive", nil, '{"ID":' .. mine[(n % #mine) + 1] .. '}')
end
