-- POST a JSON body ($WRK_BODY) and print a JSON summary line at the end.
-- Used by bench/gateway_overhead.py: wrk -s bench/wrk_post.lua URL
wrk.method = "POST"
wrk.body = os.getenv("WRK_BODY") or '{"model":"fake","messages":[{"role":"user","content":"Say hello."}],"max_tokens":64}'
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"status_errors":%d,"connect_errors":%d,' ..
    '"read_errors":%d,"write_errors":%d,"timeouts":%d,"p50_us":%.1f,"p90_us":%.1f,"p99_us":%.1f,' ..
    '"mean_us":%.1f,"max_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
