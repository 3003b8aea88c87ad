-- wrk script: POST with fixed fencing headers: wrk ... -s bench/post_token.lua URL -- JOB TOKEN
function init(args)
  wrk.method = "POST"
  wrk.body = "x"
  wrk.headers["X-Fencing-Job"] = args[1]
  wrk.headers["X-Fencing-Token"] = args[2]
end

function done(summary, latency, requests)
  io.write(string.format("non-2xx: %d\n", summary.errors.status))
end
