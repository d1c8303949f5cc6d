#!/bin/sh
# Secrets as files (compose `secrets:`, Kubernetes Secret volumes): for every MINIPAGED_X_FILE=PATH
# in the environment, export MINIPAGED_X with the file's content (CRs and the whitespace around it
# dropped: a file saved with CRLF line ends holds the same token) and unset MINIPAGED_X_FILE, then
# exec the command. The services read their tokens from the
# environment (metadata service: MINIPAGED_TOKEN, MINIPAGED_WORKER_TOKEN; worker:
# MINIPAGED_WORKER_TOKEN; gateway: MINIPAGED_TOKEN, MINIPAGED_METADATA_TOKEN), so a secret never
# appears in a command line, in `docker inspect` or in the compose file.
# A named file that is missing, empty, blank or unreadable is a start error (exit 78, EX_CONFIG): a
# service that was meant to have a token never starts without one.
set -eu
for var in $(env | sed -n 's/^\(MINIPAGED_[A-Z0-9_]*\)_FILE=.*/\1/p'); do
  eval "path=\${${var}_FILE}"
  if [ ! -f "$path" ] || [ ! -r "$path" ] || [ ! -s "$path" ]; then
    echo "entrypoint: ${var}_FILE=$path is not a readable, non-empty file (uid $(id -u))." >&2
    echo "entrypoint: create it first (docker/make-secrets.sh; see docs/containers.md)." >&2
    exit 78
  fi
  value=$(tr -d '\r' < "$path" | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//')
  if [ -z "$value" ]; then
    echo "entrypoint: ${var}_FILE=$path holds only whitespace: a token file must hold the token." >&2
    exit 78
  fi
  export "$var=$value"
  unset "${var}_FILE"
done
exec "$@"
