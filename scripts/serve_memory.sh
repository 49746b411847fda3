#!/bin/bash
# Resident memory of flashdraft serve after its model loads, per -c / -np (the KV cache is
# allocated at load: one stream per slot plus one per slot prompt cache, plus one spare).
# usage: scripts/serve_memory.sh   (prints one line per setting)
cd "$(dirname "$0")/.."
for cfg in "-c 4096 -np 1" "-c 0 -np 1" "-c 16384 -np 2" "-c 32768 -np 4"; do
  port=$((8300 + RANDOM % 500))
  .venv/bin/flashdraft serve --spec-type ngram --spec-dm-controller cost -t 2 $cfg --port $port > /dev/null 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  rss=$(grep VmRSS /proc/$pid/status | awk '{print $2}')
  nctx=$(curl -s http://127.0.0.1:$port/props | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['default_generation_settings']['n_ctx'])")
  echo "$cfg: RSS $((rss/1024)) MiB, n_ctx per slot $nctx"
  kill $pid; wait $pid 2>/dev/null
done
