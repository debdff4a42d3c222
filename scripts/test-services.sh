#!/usr/bin/env bash
# Install the servers the end-to-end tests start themselves (nginx,
# Prometheus/promtool, PostgreSQL for the usage ledger's tests, which run
# their own with initdb/pg_ctl; redis-server for the shared limits' tests,
# which start their own on a loopback port: Debian has no valkey-server, and
# Redis 7 speaks the same protocol) and the browser the console test drives
# (Debian's chromium, through Playwright). Needs root or sudo; skips what is
# already there.
set -euo pipefail
need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1 || need+=(postgresql)
command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || need+=(redis-server)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "[test-services] installing ${need[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
  # Debian starts them as services; the tests run their own on 127.0.0.1.
  $SUDO systemctl stop nginx prometheus 2>/dev/null || true
  $SUDO pkill -x nginx 2>/dev/null || true
  $SUDO pkill -x prometheus 2>/dev/null || true
  $SUDO service postgresql stop 2>/dev/null || true
  $SUDO service redis-server stop 2>/dev/null || true
fi
