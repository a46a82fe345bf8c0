#!/bin/bash
# Runs as PID 1 of a fresh pid/mount/cgroup namespace (started by capy-sandbox via
# unshare) and turns into systemd. Everything it mounts lives only in this mount
# namespace, so the host's /run, /tmp and cgroup trees are never touched.
#
# Environment from capy-sandbox:
#   CAPYSB_NAME   sandbox name (shown as the hostname-independent "container" id)
#   CAPYSB_SSH    1 = let ssh.service run (a later multi-host test wants sshd)
#   CAPYSB_NETNS  non-empty = we were started inside that network namespace
set -euo pipefail

# Private runtime and temp dirs: systemd, dbus and journald write there, and
# systemd-tmpfiles would otherwise clean the host's /tmp.
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /run/lock /run/systemd/system /run/systemd/journald.conf.d
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp

# Engine units' CacheDirectory= (/var/cache/capyctl-engine/<name>, stored under
# /var/cache/private for DynamicUser= units): systemd chowns it to the unit's dynamic user
# at each start. Shared with the host, two sandboxes starting a deployment of one name
# at once chown one directory to two users, and the first engine loses its own cache.
mkdir -p /var/cache/private /var/cache/capyctl-engine
mount -t tmpfs -o mode=0700,nosuid,nodev tmpfs /var/cache/private
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /var/cache/capyctl-engine

if [ -n "${CAPYSB_NETNS:-}" ]; then
  # A sysfs that shows this network namespace's interfaces (as `ip netns exec` does).
  mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
fi

# Units that would reach out of the sandbox (host sysctls, binfmt, clock, /etc/passwd,
# /var/log) or are just noise in a test. Masks live in /run, so they vanish with it.
masked=(
  systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service
  systemd-tmpfiles-clean.timer systemd-tmpfiles-clean.service
  systemd-sysctl.service systemd-binfmt.service proc-sys-fs-binfmt_misc.automount
  systemd-modules-load.service kmod-static-nodes.service
  systemd-sysusers.service systemd-firstboot.service systemd-machine-id-commit.service
  systemd-update-utmp.service systemd-update-utmp-runlevel.service
  systemd-random-seed.service systemd-timesyncd.service systemd-pstore.service
  systemd-journal-flush.service systemd-repart.service
  systemd-pcrphase.service systemd-pcrphase-sysinit.service
  systemd-remount-fs.service systemd-hwdb-update.service ldconfig.service
  systemd-journald-audit.socket
  sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount
  sys-fs-fuse-connections.mount dev-hugepages.mount
  getty@tty1.service console-getty.service getty.target
  postgresql.service cron.service e2scrub_reap.service
  apt-daily.timer apt-daily-upgrade.timer man-db.timer e2scrub_all.timer
  fstrim.timer dpkg-db-backup.timer
)
if [ "${CAPYSB_SSH:-0}" != 1 ]; then
  masked+=(ssh.service ssh.socket)
fi
for unit in "${masked[@]}"; do
  ln -sf /dev/null "/run/systemd/system/$unit"
done

# The journal stays in this sandbox's /run: two sandboxes share the host's machine-id
# and would otherwise write the same files under /var/log/journal. The kernel log is
# the host's, not the sandbox's: leave it out (dmesg on the host has it).
printf '[Journal]\nStorage=volatile\nReadKMsg=no\n' > /run/systemd/journald.conf.d/capysb.conf

# Boot only what a test needs: basic.target (sysinit, sockets with dbus.socket) and,
# on request, sshd. multi-user.target would start every service the host enables.
{
  echo "[Unit]"
  echo "Description=CapyCTL test sandbox ${CAPYSB_NAME}"
  echo "Requires=basic.target dbus.socket"
  echo "After=basic.target dbus.socket"
  if [ "${CAPYSB_SSH:-0}" = 1 ]; then
    echo "Wants=ssh.service"
  fi
  echo "AllowIsolate=yes"
} > /run/systemd/system/capysb.target

# cgroup namespace: the hierarchies we mount now are rooted at the sandbox's own
# cgroups (capysb-NAME on the host), so systemd owns a tree of its own.
umount -l /sys/fs/cgroup 2>/dev/null || true
mount -t tmpfs -o mode=0755,nosuid,nodev,noexec tmpfs /sys/fs/cgroup
for controller in cpu cpuacct cpuset memory devices freezer blkio pids; do
  mkdir -p "/sys/fs/cgroup/$controller"
  mount -t cgroup -o "nosuid,nodev,noexec,$controller" cgroup "/sys/fs/cgroup/$controller"
done
mkdir -p /sys/fs/cgroup/systemd /sys/fs/cgroup/unified
mount -t cgroup -o nosuid,nodev,noexec,none,name=systemd cgroup /sys/fs/cgroup/systemd
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup/unified

# systemd makes "/" shared at boot (mount-setup.c) only when it is not in a container, and
# container= is set below. Units' credentials (LoadCredential=) are mounted by a helper in a
# namespace of its own and reach PID 1's namespace only by propagation: without shared mounts
# every unit would see an empty /run/credentials/<unit>. Peer groups made here are this
# namespace's own (unshare made the host's mounts private to it), so nothing reaches the host.
mount --make-rshared /

exec env -i container=capysb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /lib/systemd/systemd --system --unit=capysb.target --log-target=console --show-status=false
