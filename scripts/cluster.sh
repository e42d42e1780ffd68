#!/usr/bin/env bash
# A simulated cluster on this machine (docs/hpc.md): N hosts, each a network namespace with its own
# hostname (UTS namespace) and its own /dev/shm (mount namespace), joined by veth pairs to one bridge, with
# addresses from 198.18.0.0/15 (reserved for benchmarks) and optionally rate-limited links (tbf). MPICH's hydra
# starts ranks across them through an ssh-shaped launcher wrapper that enters a host's namespaces instead of ssh.
#
#   scripts/cluster.sh up N [--rate R]   N hosts n0..n(N-1), each link limited to R (a tc rate: 100mbit, 1gbit)
#   scripts/cluster.sh run [--image] NP ARGS...
#                                        python -m mpi_fnas.run ARGS... with NP ranks, round-robin over the hosts
#                                        from n0 (rank 0 on n0), run from n0 with the project's venv; --image: each
#                                        rank in the image of `make image` (MPI_FNAS_IMAGE, default
#                                        /var/tmp/mpi_fnas-image/img/mpi_fnas), started by this machine's hydra
#                                        (the hybrid model: the host's launcher, the image's MPICH); the checkout
#                                        is bound at /opt/mpi_fnas, the ranks' working directory; /tmp is shared
#   scripts/cluster.sh status            the hosts, their addresses, links and byte counters
#   scripts/cluster.sh down              removes every namespace, link, bridge and file that `up` made
#   scripts/cluster.sh exec HOST CMD...  CMD inside HOST's namespaces, as ssh would run it (hydra's launcher)
#   scripts/cluster.sh on HOST ARGV...   ARGV inside HOST's namespaces, exactly as given (no shell; a daemon's PID
#                                        is the caller's child: tests/slurm_cluster.py starts Slurm's daemons so)
#
# --delay and --loss are refused: this kernel has no netem, and a delay through a userspace forwarder is not
# honest at these timer resolutions (a "2 ms" sleep lasts ~12 ms here). Root only. Everything `up` makes is named
# mfc-* (MFC_PREFIX), and `down` removes it all; a failed `up` removes what it made before it exits.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
mpiexec=${MPIEXEC:-$here/.venv/bin/mpiexec}
state=${MFC_STATE:-/run/mpi_fnas_cluster}  # the cluster's files: hosts, its /etc/hosts, the rate, the ssh wrapper
prefix=${MFC_PREFIX:-mfc}  # every namespace and link is named <prefix>-*: `down` removes exactly those
bridge=$prefix-br0
subnet=198.18.0  # 198.18.0.1 .. 198.18.0.N: host n(i) at .(i+1)

die() { echo "cluster.sh: $*" >&2; exit 2; }
need_root() { [ "$(id -u)" = 0 ] || die "needs root (network namespaces, veth pairs, tc)"; }
hosts() { cat "$state/hosts" 2>/dev/null || true; }

up() {
  local n=${1:-}; shift || true
  [[ "$n" =~ ^[1-9][0-9]*$ ]] && [ "$n" -le 200 ] || die "up: N must be an integer in 1..200, got '${n}'"
  local rate=""
  while [ $# -gt 0 ]; do
    case $1 in
      --rate) rate=${2:?--rate needs a value, e.g. 100mbit}; shift 2 ;;
      --delay|--loss) die "$1: refused: this kernel has no netem qdisc, and a delay through a userspace forwarder is not honest at this machine's timer resolution; use --rate" ;;
      *) die "up: unknown option $1" ;;
    esac
  done
  need_root
  [ -e "$state/hosts" ] && die "a cluster is already up ($(hosts | tr '\n' ' ')); scripts/cluster.sh down first"
  mkdir -p "$state"
  trap 'echo "cluster.sh: up failed; removing what it made" >&2; down >/dev/null 2>&1 || true' ERR
  ip link add "$bridge" type bridge
  ip link set "$bridge" up
  : > "$state/etc_hosts"
  printf '127.0.0.1 localhost\n' >> "$state/etc_hosts"
  for i in $(seq 0 $((n - 1))); do
    local ns=$prefix-n$i
    ip netns add "$ns"
    echo "n$i" >> "$state/hosts"
    printf '%s.%d n%d\n' "$subnet" $((i + 1)) "$i" >> "$state/etc_hosts"
    ip link add "$prefix-v$i" type veth peer name eth0 netns "$ns"
    ip link set "$prefix-v$i" master "$bridge" up
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    if [ -n "$rate" ]; then  # both directions of the link: the host's egress and the bridge port's
      tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst 64kb latency 50ms
      tc qdisc add dev "$prefix-v$i" root tbf rate "$rate" burst 64kb latency 50ms
    fi
  done
  echo "${rate:-unlimited}" > "$state/rate"
  printf '#!/bin/sh\nexec "%s" exec "$@"\n' "$here/scripts/cluster.sh" > "$state/ssh"  # hydra's -launcher-exec
  chmod +x "$state/ssh"
  trap - ERR
  echo "cluster.sh: up: $n hosts (n0..n$((n - 1)), $subnet.1-$n), links ${rate:-unlimited}"
}

down() {
  local i
  for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-n" || true); do
    # What still runs on the host (ranks of a killed job, their hydra proxy) is ours: it ends with the host.
    ip netns pids "$ns" | xargs -r kill -9 2> /dev/null || true
    ip netns delete "$ns"
  done
  for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$prefix-" || true); do
    ip link delete "$link" 2>/dev/null || true
  done
  rm -rf "$state"
  if ip netns list | grep -q "^$prefix-n" || ip -o link show | grep -q ": $prefix-"; then
    die "down: some of the cluster is left: $(ip netns list | grep "^$prefix-") $(ip -o link show | grep ": $prefix-")"
  fi
  echo "cluster.sh: down: nothing of the cluster is left"
}

status() {
  [ -e "$state/hosts" ] || { echo "cluster.sh: no cluster is up"; return 0; }
  echo "links: $(cat "$state/rate")"
  local i=0
  for h in $(hosts); do
    local ns=$prefix-$h
    local rx tx
    rx=$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes)
    tx=$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)
    echo "$h $subnet.$((i + 1)) rx_bytes=$rx tx_bytes=$tx"
    i=$((i + 1))
  done
}

# enter HOST CMD...: CMD (exact argv) in HOST's network namespace, with its own hostname, /dev/shm and /etc/hosts
# (a private mount namespace: nothing is mounted on this machine's own).
enter() {
  local host=${1:?enter: which host?}; shift
  [ -e "/run/netns/$prefix-$host" ] || die "no host $host in the cluster"
  exec nsenter --net="/run/netns/$prefix-$host" unshare --uts --mount -- /bin/sh -c \
    'hostname "$0" && mount -t tmpfs -o size=1g tmpfs /dev/shm && mount --bind "$1" /etc/hosts && shift && exec "$@"' \
    "$host" "$state/etc_hosts" "$@"
}

# exec [ssh options] HOST COMMAND...: what hydra's ssh launcher calls (through $state/ssh). As ssh does, the
# command words are joined and read by a shell on the "far side".
exec_on() {
  while [ $# -gt 0 ] && [[ "$1" == -* ]]; do
    case $1 in -p|-l|-i|-o|-F) shift 2 ;; *) shift ;; esac
  done
  local host=${1:?exec: which host?}; shift
  enter "$host" /bin/sh -c "$*"
}

run() {
  local rank_cmd=("$python" -m mpi_fnas.run)
  if [ "${1:-}" = --image ]; then
    shift
    local image=${MPI_FNAS_IMAGE:-/var/tmp/mpi_fnas-image/img/mpi_fnas}
    [ -d "$image" ] || die "run --image: no image at $image (make image, or set MPI_FNAS_IMAGE)"
    # --set-env: the image's ENV (its venv first on PATH), then one torch thread per rank as below. The checkout is
    # bound over the image's copy of the sources (/opt/mpi_fnas: configs, slurm; the code runs from the image's
    # venv) and is the working directory, so ARGS mean what they mean for venv ranks. ch-run shares /tmp.
    command -v ch-run >/dev/null || die "run --image: needs Charliecloud's ch-run (apt-get install charliecloud)"
    rank_cmd=(ch-run --set-env --set-env=OMP_NUM_THREADS=1 -b "$here:/opt/mpi_fnas" -c /opt/mpi_fnas "$image" --
              python -m mpi_fnas.run)
  fi
  local np=${1:-}; shift || true
  [[ "$np" =~ ^[1-9][0-9]*$ ]] || die "run: NP must be a positive integer, got '${np}'"
  [ -e "$state/hosts" ] || die "run: no cluster is up; scripts/cluster.sh up N first"
  local list
  list=$(hosts | paste -sd, -)
  # Hosts share this machine's cores: one torch thread per rank (OMP_NUM_THREADS, which mpi_fnas.run honours when
  # runtime.threads_per_rank is unset), whatever each rank counts on its "node".
  # UCX_TLS=tcp,self: UCX would find shared memory across the namespaces otherwise.
  # MPIR_CVAR_CH4_CMA_ENABLE=0: two ranks of one host in separate containers (user namespaces) cannot attach to
  # each other's memory (cross-memory attach), and MPI_Init fails; MPICH then copies through /dev/shm instead. Set
  # for venv ranks too (one rule for both; a host runs one rank unless NP exceeds the hosts).
  # USER: ch-run needs it, and hydra passes this environment on to every rank.
  enter n0 env -C "$here" UCX_TLS=tcp,self OMP_NUM_THREADS=1 USER="${USER:-$(id -un)}" \
    "$mpiexec" -hosts "$list" -launcher ssh -launcher-exec "$state/ssh" -iface eth0 \
    -genv UCX_TLS tcp,self -genv OMP_NUM_THREADS 1 -genv MPIR_CVAR_CH4_CMA_ENABLE 0 -n "$np" \
    "${rank_cmd[@]}" "$@"
}

cmd=${1:-}; shift || true
case $cmd in
  up) up "$@" ;;
  down) need_root; down ;;
  status) status ;;
  run) run "$@" ;;
  exec) exec_on "$@" ;;
  on) enter "$@" ;;
  *) die "usage: scripts/cluster.sh up N [--rate R] | run [--image] NP ARGS... | status | down | on HOST ARGV... | exec HOST CMD..." ;;
esac
