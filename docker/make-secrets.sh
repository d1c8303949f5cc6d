#!/bin/sh
# Create the compose secrets once: client_token (the metadata service's client API), worker_token
# (worker registration and the worker links), gateway_token (the gateway's HTTP API).
#   docker/make-secrets.sh            # into docker/secrets/ (git- and docker-ignored)
#   MINIPAGED_SECRETS_DIR=DIR docker/make-secrets.sh
# An existing non-empty file is kept (rotate a token by deleting its file and restarting the stack).
# The folder is 0700 (only you can reach the files on the host); the files are 0644 because compose
# bind-mounts them as they are and the services run as uid 10001 in their containers.
set -eu
dir=${MINIPAGED_SECRETS_DIR:-$(dirname "$0")/secrets}
mkdir -p "$dir"
chmod 700 "$dir"
for name in client_token worker_token gateway_token; do
  if [ -s "$dir/$name" ]; then
    echo "kept    $dir/$name"
  else
    head -c 32 /dev/urandom | base64 | tr -d '/+=\n' >"$dir/$name"
    echo "created $dir/$name"
  fi
  chmod 644 "$dir/$name"
done
