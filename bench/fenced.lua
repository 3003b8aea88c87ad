-- wrk script: every request of a thread is a POST on job "bench-<thread>" with the token
-- chosen by MODE: "same" (always 1), "bump" (1, 2, 3, ... : a durable bump per request) or
-- "idem" (token 1, a new Idempotency-Key per request). One connection per thread, so a
-- thread's requests are sequential and every bump is accepted.
-- "spread": a bump per request like "bump", but a thread's requests go round its JOBS jobs
-- (third argument) in turn, so that a thread's many connections do not queue on one job;
-- with JOBS well above the thread's connections, a job has one request in flight at a time.
local counter = 0
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  mode = args[1] or "same"
  -- A second argument names the jobs apart, for several wrk runs at once.
  job = (args[2] or "bench") .. "-" .. id .. "-" .. tostring(os.time())
  jobs = tonumber(args[3] or "1")
  wrk.method = "POST"
  wrk.body = "x"
end

function request()
  counter = counter + 1
  local headers = { ["X-Fencing-Job"] = job, ["Content-Type"] = "text/plain" }
  if mode == "spread" then
    headers["X-Fencing-Job"] = job .. "-" .. (counter % jobs)
  end
  if mode == "bump" or mode == "spread" then
    headers["X-Fencing-Token"] = tostring(counter)
  else
    headers["X-Fencing-Token"] = "1"
  end
  if mode == "idem" then
    headers["Idempotency-Key"] = "k" .. counter
  end
  return wrk.format(nil, "/", headers, nil)
end

function response(status, headers, body)
  if status ~= 200 then
    rejected = (rejected or 0) + 1
  end
end

function done(summary, latency, requests)
  local non2xx = summary.errors.status
  io.write(string.format("non-2xx: %d\n", non2xx))
end
