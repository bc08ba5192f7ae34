#!/bin/sh
# A gRPC health check for a load balancer that runs a command per check, with curl alone (no
# Python, no grpc_health_probe): haproxy's `external-check command` calls it with the proxy's
# address and port, then the server's ("$3" "$4"). Exit 0 only when the replica's own code
# answers grpc.health.v1.Health/Check with SERVING: a SIGSTOPped process's kernel still accepts
# a TCP connect, and a replica that cannot reach Postgres answers NOT_SERVING.
#
# The request is an empty HealthCheckRequest in gRPC's framing (5 zero bytes); the answer
# SERVING is the frame 00 00000002 08 01 (field 1 = 1). A light command matters: a check runs
# every few seconds per replica, and haproxy gives it about its connect timeout.
addr=${3:-$1}
port=${4:-$2}
body=$(printf '\000\000\000\000\000' \
  | curl -s --http2-prior-knowledge --max-time "${GRPC_CHECK_TIMEOUT_S:-1.5}" -X POST \
      -H 'content-type: application/grpc' -H 'te: trailers' --data-binary @- \
      "http://$addr:$port/grpc.health.v1.Health/Check" \
  | od -An -tx1 | tr -d ' \n')
[ "$body" = "00000000020801" ]
