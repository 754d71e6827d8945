#!/bin/sh
# Runs a command as a "node" of its own: in a private mount namespace whose /dev/shm is
# the directory $1 (bind-mounted), so shared memory is not shared with the other nodes of
# a test and what the node leaves behind can be read afterwards.
#   private_shm.sh DIR COMMAND [ARGS...]
dir=$1
shift
exec unshare -m --propagation private sh -c 'mount --bind "$0" /dev/shm && exec "$@"' "$dir" "$@"
