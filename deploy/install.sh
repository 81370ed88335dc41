#!/usr/bin/env bash
# Installs larderd as a systemd service on this machine (run as root from the repository root).
set -euo pipefail
cargo build --release --locked
install -m 0755 target/release/larderd target/release/larder /usr/local/bin/
# The daemon's own user and group; users in group larder may connect to its socket.
id -u larder >/dev/null 2>&1 || useradd --system --user-group --no-create-home --shell /usr/sbin/nologin larder
# The user the config's datasets are read as (reader_user): it owns nothing and may read only
# what the admin lets it.
id -u larder-reader >/dev/null 2>&1 || useradd --system --user-group --no-create-home --shell /usr/sbin/nologin larder-reader
install -d -m 0755 /etc/larder
[ -e /etc/larder/larder.toml ] || install -m 0644 deploy/larder.toml /etc/larder/larder.toml
install -m 0644 deploy/larderd.service /etc/systemd/system/larderd.service
# The docs the unit's Documentation= points at.
install -d -m 0755 /usr/share/doc/larder
install -m 0644 README.md docs/*.md /usr/share/doc/larder/
systemctl daemon-reload
echo "edit /etc/larder/larder.toml (datasets must be readable by user larder-reader), then:"
echo "  systemctl enable --now larderd"
echo "  usermod -aG larder USER    # for each user who may connect (then they log in again)"
