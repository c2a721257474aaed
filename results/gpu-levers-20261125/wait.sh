#!/usr/bin/env bash
# Block (at most LIMIT s) until run.sh has started every server and each is healthy or gone; print where things stand.
LIMIT=${LIMIT:-540}; t0=$(date +%s)
ready() { grep -q "^ready:" "/root/run/$1.serve" 2>/dev/null; }
while :; do
  left=0
  if [ -f /root/run/ORCH_DONE ]; then
    while read -r tag v port pid extra; do ready $tag || ! kill -0 $pid 2>/dev/null || left=$((left + 1)); done < /root/run/servers
  else left=1; fi
  [ $left = 0 ] && break
  [ $(( $(date +%s) - t0 )) -gt $LIMIT ] && { echo "still waiting"; break; }
  sleep 3
done
tail -${ORCH_TAIL:-25} /root/run/orch.out
while read -r tag v port pid extra; do
  if ready $tag; then echo "$tag: $(grep '^ready:' /root/run/$tag.serve)"
  elif kill -0 $pid 2>/dev/null; then echo "$tag: starting"
  else echo "$tag: GONE"; tail -3 /root/run/$tag.serve; grep -E "Error|error" /root/run/$tag.log | tail -4; fi
done < /root/run/servers
nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader
echo "waited $(( $(date +%s) - t0 )) s"
