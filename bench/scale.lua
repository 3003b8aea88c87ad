-- wrk script for bench/sink_scale.sh. Argument: JOBS. Every request is a POST with token 1 on
-- a job drawn uniformly from "s-0" .. "s-<JOBS-1>" (all stored at generation 1 beforehand).
local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  jobs = tonumber(args[1])
  math.randomseed(os.time() * 1000 + id)
  wrk.method = "POST"
  wrk.body = "x"
end

function request()
  local j = math.random(0, jobs - 1)
  return wrk.format(nil, "/", { ["X-Fencing-Job"] = "s-" .. j, ["X-Fencing-Token"] = "1" }, nil)
end
