#!/usr/bin/env bash
# streamkit quickstart: start a broker, create journals from a spec file, append,
# read back over gRPC and HTTP, then stop the broker gracefully (which persists
# the open fragments as files). Set STREAMKIT_PORT to use a port other than 8080.
set -euo pipefail
cd "$(dirname "$0")/../.."

PORT=${STREAMKIT_PORT:-8080}
DATA=.streamkit/quickstart
export STREAMKIT_BROKER=127.0.0.1:$PORT
mkdir -p "$DATA"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "starting the broker on 127.0.0.1:$PORT (data in $DATA, log in $DATA/broker.log)"
streamkit broker serve --data-dir "$DATA" --port "$PORT" > "$DATA/broker.log" 2>&1 &
BROKER=$!
trap 'kill -TERM $BROKER 2>/dev/null || true; wait $BROKER 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    streamkit journals list > /dev/null 2>&1 && break
    kill -0 $BROKER 2>/dev/null || { cat "$DATA/broker.log"; exit 1; }
    sleep 0.1
done

step "applying examples/quickstart/journals.yaml"
streamkit journals apply --specs examples/quickstart/journals.yaml --upsert
streamkit journals list -l app=quickstart

step "appending"
for i in 1 2 3 4 5; do echo "{\"event\": $i, \"at\": \"$(date -u +%FT%TZ)\"}"; done \
    | streamkit journals append examples/events --framing lines
printf 'hello\nworld\n' | streamkit journals append examples/logs

step "reading examples/events over gRPC"
streamkit journals read examples/events

step "reading examples/logs over HTTP (curl)"
curl -s "http://127.0.0.1:$((PORT + 1))/examples/logs?offset=0"

step "stopping the broker (SIGTERM): open spools are persisted"
kill -TERM $BROKER && wait $BROKER || true
trap - EXIT
find "$DATA/fragments" -type f | sort
