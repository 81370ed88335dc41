#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/larder.sh) on every node of a job:
# makes sure the node's larderd (the Debian package's systemd service) runs and answers before
# the job starts, so that no rank meets a node without one. It starts the service when it is
# installed but stopped, and drains nothing: a node whose daemon does not answer in time fails
# the prolog, and Slurm requeues the job elsewhere and drains the node.
set -euo pipefail
socket="${LARDER_SOCKET:-/run/larder/larder.sock}"
if ! systemctl is-active --quiet larderd; then
    systemctl start larderd
fi
for _ in $(seq 60); do
    if /usr/bin/larder --addr "unix:$socket" stats >/dev/null 2>&1; then
        exit 0
    fi
    sleep 1
done
echo "larder prolog: larderd on $(hostname) does not answer at $socket" >&2
exit 1
