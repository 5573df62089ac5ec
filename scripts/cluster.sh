#!/usr/bin/env bash
# A cluster on one machine: H "hosts", each a network namespace with its own host name, joined by
# one bridge, with Open MPI started across them the way it starts across real machines (one
# orted daemon per host, launched through an rsh agent, TCP between hosts, shared memory only
# within a host). For trying multi-node runs before there is a cluster, and for CI (scripts/test.sh,
# stage multihost). Needs root (network namespaces, veth pairs, tc). See docs/multi-node.md.
#
# Usage:
#   cluster.sh up H [--rate RATE] [--burst SIZE] [--latency TIME] [--slots N]
#       H hosts (1..250) named <cluster>-h0 .. <cluster>-h<H-1>, at 10.231.0.1 .. 10.231.0.H.
#       --rate 2gbit shapes each host's egress with a tc tbf qdisc (and --burst, default
#       max(8 ms at RATE, 256kb), --latency, default 20ms); --slots N (default nproc) ranks per
#       host in the hostfile. Idempotent: the same cluster up again is left as it is (processes
#       left in it by a killed run are ended); a different one replaces it.
#   cluster.sh run [mpiexec args] [--] program [args]
#       mpiexec started in host 0 (as `exec 0` does), with the cluster's hostfile, rsh agent and transports
#       (--mca btl tcp,self,vader over the bridge's subnet). E.g. 2 hosts x 2 ranks:
#       cluster.sh run -n 4 --map-by ppr:2:node -- build/examples/hello_world
#       Every process the run left in the cluster is ended when it returns or is killed. The
#       first "--" is dropped (give one when the program's own arguments hold a "--"), so
#       `cluster.sh run` can stand for mpiexec in scripts that take an MPIEXEC. One run at a time
#       per cluster (the end of one ends every process in the cluster, but for the processes
#       it was started from: `exec 0 lockstep-run --mpiexec "cluster.sh run"` lives on).
#   cluster.sh up --slurm H [options as above]
#       The same hosts, plus a Slurm cluster on them (Debian's slurmctld, slurmd, munge): munged
#       (in the bridge's namespace, its own key and socket), slurmctld in host 0, one slurmd per
#       host in that host's namespaces, each with its host name, spool and /tmp, and
#       a partition 'batch' (the default) holding every host with --slots CPUs each (default
#       nproc). Slurm's commands run on a host through `exec`. Waits until every node is idle.
#   cluster.sh exec HOST command...
#       command (sbatch, srun, sinfo, scontrol, squeue, mpiexec, lockstep-run...) on HOST
#       (<cluster>-h<i>, h<i>, <i> or its address): in its network namespace, under its host name,
#       with its /tmp, SLURM_CONF set to the cluster's slurm.conf, and Open MPI's settings for the
#       cluster (root allowed, no binding, TCP on the bridge's subnet, yield when idle), which
#       sbatch and srun pass on to the job. Exits with the command's status.
#   cluster.sh down       removes every namespace, link, daemon and file of the cluster (idempotent).
#   cluster.sh status     prints the hosts, their addresses and qdiscs.
#   cluster.sh agent HOST command...   the rsh agent mpiexec calls (not for users).
#
# Exit codes: that of the command (run, exec), 0 otherwise; 77 where network namespaces cannot be
# made (not root, no iproute2/unshare, a kernel or container that refuses them) or, for --slurm,
# where Slurm or munge is not installed, so callers report skipped; 2 for usage errors.
#
# Environment: LOCKSTEP_CLUSTER (default lockstep): the cluster's name, prefix of its namespaces;
# two clusters with different names can be up at once (they share nothing, not even the subnet's
# routing: each bridge lives in a namespace of its own). LOCKSTEP_CLUSTER_SUBNET (default 10.231.0):
# the first three octets of the hosts' /24.
#
# What is made: a namespace <cluster>-br holding bridge br0 (and no address); per host a namespace
# <cluster>-h<i> holding lo and eth0 (<i+1> on the subnet, no default route), eth0's peer h<i>
# attached to br0. Every process of a host (mpiexec, the orted daemons, the ranks, `exec`'s
# command) runs in a mount namespace of its own where /tmp is the host's own folder
# (/run/<cluster>-cluster/h<i>/tmp) and TMPDIR=/tmp: as on a real cluster, the hosts share no
# /tmp, only the source and build tree (and the rest of the file system). Nothing is added to the root namespace's network, so no traffic can leave the
# cluster. State (hostfile, agent, each host's /tmp; for --slurm slurm.conf, the munge key and
# socket, every daemon's spool, log and pid file, a hosts file naming every host) in
# /run/<cluster>-cluster, and nothing elsewhere. Interrupted (INT, TERM, HUP), `up` removes what
# it made.
set -uo pipefail

NAME=${LOCKSTEP_CLUSTER:-lockstep}
SUBNET=${LOCKSTEP_CLUSTER_SUBNET:-10.231.0}
SELF=$(readlink -f "${BASH_SOURCE[0]}")
STATE=/run/$NAME-cluster
SOURCE_ROOT=$(dirname "$(dirname "$SELF")")  # the source tree: shared with every host
BR=$NAME-br

die() { echo "cluster.sh: $1" >&2; exit "${2:-1}"; }
usage() { sed -n '/^# Usage:/,/^# Exit codes/p' "$SELF" | sed 's/^# \{0,1\}//' | sed '$d' >&2; exit 2; }

host_ns() { echo "$NAME-h$1"; }

# Exits 77 (skip) unless this process can make network and UTS namespaces.
need_namespaces() {
  [ "$(id -u)" -eq 0 ] ||
    die "needs root (network namespaces, veth pairs, tc); run it as root, e.g. sudo $0 $*" 77
  local tool
  for tool in ip unshare nsenter; do
    command -v "$tool" >/dev/null || die "needs '$tool' (iproute2, util-linux)" 77
  done
  unshare --uts true 2>/dev/null || die "cannot make a UTS namespace here (unshare --uts failed)" 77
  local probe=$NAME-probe$$
  ip netns add "$probe" 2>/dev/null || die "cannot make a network namespace here (ip netns add failed)" 77
  ip netns del "$probe"
}

# Our namespaces, whether or not the state directory survived.
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-(br|h[0-9]+)\$"; }

# The Slurm cluster's daemons (munged, slurmctld, the slurmds), from their pid files.
daemon_pids() {
  cat "$STATE"/slurm/munge/munged.pid "$STATE"/slurm/ctld/slurmctld.pid "$STATE"/slurm/h*/slurmd.pid 2>/dev/null
}

# Ends every process inside the cluster's namespaces (only this script's runs put any there):
# TERM, then KILL whatever is left after 3 s. `end_processes keep-daemons` spares the Slurm
# daemons (what `run` and a repeated `up` end is what a run left, not the cluster).
end_processes() {
  local ns pids sig keep=() p
  [ "${1:-}" = keep-daemons ] && mapfile -t keep < <(daemon_pids)
  # The processes this one was started from (a lockstep-run in host 0 whose mpiexec this is).
  p=$PPID
  while [ -n "$p" ] && [ "$p" -gt 1 ]; do
    keep+=("$p")
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null)
  done
  for sig in TERM KILL; do
    pids=""
    for ns in $(our_namespaces); do pids+=" $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"; done
    pids=$(echo "$pids" | tr ' ' '\n' | grep -v -x -e '' -e "$$" "${keep[@]/#/-e}" | sort -u | tr '\n' ' ')
    [ -n "${pids// /}" ] || return 0
    # shellcheck disable=SC2086  # a list of process ids
    kill -s "$sig" $pids 2>/dev/null
    [ "$sig" = KILL ] && return 0
    for _ in $(seq 30); do
      # shellcheck disable=SC2086
      kill -0 $pids 2>/dev/null || return 0
      sleep 0.1
    done
  done
}

cmd_down() {
  [ "$(id -u)" -eq 0 ] || die "needs root to remove the cluster's namespaces" 77
  end_processes
  local ns
  for ns in $(our_namespaces); do ip netns del "$ns" 2>/dev/null || echo "cluster.sh: could not remove namespace $ns" >&2; done
  rm -rf "$STATE"
}

cmd_up() {
  local slurm=""
  if [ "${1:-}" = --slurm ]; then slurm=1; shift; fi
  [ $# -ge 1 ] || usage
  local hosts=$1 rate="" burst="" latency=20ms slots
  slots=$(nproc)
  shift
  [[ $hosts =~ ^[0-9]+$ ]] && [ "$hosts" -ge 1 ] && [ "$hosts" -le 250 ] || die "up: H must be 1..250, not '$hosts'" 2
  while [ $# -gt 0 ]; do
    case $1 in
      --rate) rate=${2:?--rate needs a value, e.g. 2gbit}; shift 2 ;;
      --burst) burst=${2:?--burst needs a size, e.g. 512kb}; shift 2 ;;
      --latency) latency=${2:?--latency needs a time, e.g. 20ms}; shift 2 ;;
      --slots) slots=${2:?--slots needs a number}; shift 2 ;;
      --slurm) slurm=1; shift ;;
      *) die "up: unknown option '$1'" 2 ;;
    esac
  done
  need_namespaces up
  [ -z "$slurm" ] || need_slurm
  if [ -n "$rate" ]; then
    command -v tc >/dev/null || die "--rate needs 'tc' (iproute2)" 77
    if [ -z "$burst" ]; then
      # 8 ms worth of the rate, at least 256 kB: a veth carries GSO packets of up to 64 kB, and a
      # smaller bucket does not fill the rate. Measured, MPI_Send of 16 MiB messages between two
      # hosts (the payload can reach 95.6% of the rate, 1448 of 1514 bytes per frame): at 1gbit,
      # 0.71 Gbit/s with a 64kb burst, 0.93 with 256kb, 0.95 with 1mb; at 2gbit, 1.30 with 64kb,
      # 1.6-1.7 with 512kb-1mb, 1.88 with 2mb.
      burst=$(tc_burst "$rate") || die "up: cannot read rate '$rate' (e.g. 500mbit, 2gbit)" 2
    fi
  fi
  local config="hosts=$hosts rate=$rate burst=$burst latency=$latency slots=$slots subnet=$SUBNET${slurm:+ slurm=1}"
  if [ -f "$STATE/config" ] && [ "$(cat "$STATE/config")" = "$config" ] && cluster_complete "$hosts" &&
    { [ -z "$slurm" ] || slurm_alive; }; then
    if [ -n "$slurm" ]; then
      # What a killed run left behind: every job, and any process that is not a daemon.
      slurm_cmd 0 scancel --full --partition=batch >/dev/null 2>&1
      sleep 1
    fi
    end_processes keep-daemons
    echo "cluster.sh: cluster '$NAME' is up: $hosts host(s)${rate:+, egress $rate}${slurm:+, Slurm partition batch}"
    return 0
  fi
  cmd_down
  # Interrupted or failed half way: take down what was made.
  trap 'cmd_down; exit 1' ERR
  trap 'cmd_down; exit 130' INT TERM HUP
  set -E
  mkdir -p "$STATE"
  ip netns add "$BR"
  ip -n "$BR" link set lo up
  ip -n "$BR" link add br0 type bridge
  ip -n "$BR" link set br0 up
  local i ns
  : >"$STATE/hostfile"
  for ((i = 0; i < hosts; i++)); do
    ns=$(host_ns "$i")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Made inside the bridge's namespace, the peer moved straight into the host's: neither end
    # ever exists in the root namespace.
    ip -n "$BR" link add "h$i" type veth peer name eth0 netns "$ns"
    ip -n "$BR" link set "h$i" master br0 up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    mkdir -p "$STATE/h$i/tmp" && chmod 1777 "$STATE/h$i/tmp"
    ip -n "$ns" link set eth0 up
    if [ -n "$rate" ]; then
      tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency "$latency"
    fi
    echo "$SUBNET.$((i + 1)) slots=$slots" >>"$STATE/hostfile"
  done
  # The rsh agent mpiexec calls: a file of its own, since plm_rsh_agent splits its value at spaces.
  printf '#!/bin/sh\nexec %q agent "$@"\n' "$SELF" >"$STATE/agent"
  chmod +x "$STATE/agent"
  set +E
  trap - ERR
  # Every bridge port forwarding before anyone relies on it (no STP: at once, normally).
  for _ in $(seq 50); do
    [ "$(bridge -n "$BR" link show | grep -c 'state forwarding')" -eq "$hosts" ] && break
    sleep 0.1
  done
  [ "$(bridge -n "$BR" link show | grep -c 'state forwarding')" -eq "$hosts" ] ||
    { cmd_down; die "up: the bridge's ports did not reach the forwarding state"; }
  if [ -n "$slurm" ]; then
    slurm_up "$hosts" "$slots" || { cmd_down; die "up: the Slurm cluster did not come up (see the log above)"; }
  fi
  echo "$config" >"$STATE/config"
  trap - INT TERM HUP
  echo "cluster.sh: cluster '$NAME' is up: $hosts host(s) $(host_ns 0)..$(host_ns $((hosts - 1))) on $SUBNET.0/24${rate:+, egress $rate (tbf burst $burst latency $latency)}${slurm:+; Slurm: partition batch, $slots CPUs a node, slurmctld on $(host_ns 0)}"
}

# tc_burst RATE: 8 ms of RATE in bytes, at least 256 kB, as "<n>b".
tc_burst() {
  awk -v r="$1" 'BEGIN {
    n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u)
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9
    if (n <= 0 || !(u in m)) exit 1
    b = n * m[u] / 8 * 0.008; if (b < 262144) b = 262144
    printf "%db\n", b }'
}

# cluster_complete H: every namespace of an H-host cluster exists (and no more hosts).
cluster_complete() {
  local want have i
  want=$( { echo "$BR"; for ((i = 0; i < $1; i++)); do host_ns "$i"; done; } | sort)
  have=$(our_namespaces | sort)
  [ "$want" = "$have" ]
}

cmd_run() {
  [ -f "$STATE/config" ] || die "run: cluster '$NAME' is not up; start it with: $0 up H"
  need_namespaces run
  # Everything goes to mpiexec, less the first "--" (which only marks where the program starts,
  # for the reader): mpiexec itself tells its options from the program.
  local args=() seen=0
  while [ $# -gt 0 ]; do
    if [ "$1" = -- ] && [ "$seen" -eq 0 ]; then seen=1; else args+=("$1"); fi
    shift
  done
  [ ${#args[@]} -gt 0 ] || die "run: no program (cluster.sh run [mpiexec args] [--] program args)" 2
  # Open MPI refuses root without these; the hosts share this machine's cores, so no binding
  # (an environment default: a --bind-to given to run wins).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_hwloc_base_binding_policy=${OMPI_MCA_hwloc_base_binding_policy:-none}
  # Every host's slots are this machine's cores, so Open MPI does not see the oversubscription
  # and busy-polls: a rank spinning for its peer's message holds the core the peer needs, and each
  # exchange can wait a scheduler time slice (docs/performance/across-hosts.md, "Across hosts"). Yielding when
  # idle lets the peer run; a real cluster, with a core per rank, does not need it.
  export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
  # mpiexec runs in host 0 (its network namespace, and a UTS namespace named after it); the
  # other hosts' orted daemons are started by the agent. Every address Open MPI may use, for its
  # own out-of-band channel and for MPI messages, is on the bridge's subnet. Given as
  # environment (OMPI_MCA_*), so that an --mca given to run wins over any of them.
  export OMPI_MCA_plm_rsh_agent=$STATE/agent OMPI_MCA_plm_rsh_no_tree_spawn=1
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self,vader
  export OMPI_MCA_btl_tcp_if_include=$SUBNET.0/24 OMPI_MCA_oob_tcp_if_include=$SUBNET.0/24
  ( in_host 0 mpiexec --hostfile "$STATE/hostfile" "${args[@]}" ) &
  local pid=$! rc
  # On a signal or any exit, end mpiexec and whatever it left in the cluster.
  trap 'kill -TERM $pid 2>/dev/null; end_processes keep-daemons; exit 143' TERM INT HUP
  trap 'end_processes keep-daemons' EXIT
  wait "$pid"
  rc=$?
  trap - TERM INT HUP
  return "$rc"
}

# The rsh agent: Open MPI calls it as `agent [options] HOST command words...`, like ssh. HOST is
# a hostfile address; the command (a shell command line, as ssh would pass it) runs on that host
# (in_host: its network namespace, its name, its /tmp).
cmd_agent() {
  while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
  [ $# -ge 2 ] || die "agent: expected HOST command..." 2
  local host=$1 i
  shift
  [[ $host == "$SUBNET".* ]] || die "agent: '$host' is not a host of cluster '$NAME' ($SUBNET.0/24)"
  i=$((${host##*.} - 1))
  in_host "$i" sh -c "$*"
}

# ---- Slurm -------------------------------------------------------------------------------------

# Exits 77 (skip) unless Debian's Slurm and munge are installed.
need_slurm() {
  local tool
  for tool in munged slurmctld slurmd sbatch srun sinfo scontrol; do
    command -v "$tool" >/dev/null ||
      die "--slurm needs '$tool' (Debian: apt-get install slurmctld slurmd slurm-client munge; scripts/install-deps.sh)" 77
  done
}

# host_index HOST: the index of HOST (<cluster>-h<i>, h<i>, <i> or <subnet>.<i+1>), or fails.
host_index() {
  local h=$1 i
  case $h in
    "$NAME"-h*) i=${h#"$NAME"-h} ;;
    h*) i=${h#h} ;;
    "$SUBNET".*) i=${h##*.}; [[ $i =~ ^[0-9]+$ ]] && i=$((i - 1)) ;;
    *) i=$h ;;
  esac
  [[ $i =~ ^[0-9]+$ ]] && ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$(host_ns "$i")" || return 1
  echo "$i"
}

# The environment of a command on a host (exec) and, through sbatch/srun, of the jobs.
cluster_env() {
  export SLURM_CONF=$STATE/slurm/slurm.conf
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_hwloc_base_binding_policy=${OMPI_MCA_hwloc_base_binding_policy:-none}
  export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
  export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1} OMPI_MCA_btl=${OMPI_MCA_btl:-tcp,self,vader}
  export OMPI_MCA_btl_tcp_if_include=${OMPI_MCA_btl_tcp_if_include:-$SUBNET.0/24}
  export OMPI_MCA_oob_tcp_if_include=${OMPI_MCA_oob_tcp_if_include:-$SUBNET.0/24}
}

# in_host I command...: command in host I's network namespace, in UTS and mount namespaces of its
# own: the host's name, the host's own /tmp bound over /tmp (TMPDIR=/tmp) and, on Slurm clusters,
# the cluster's /etc/hosts (every host's name and address) over /etc/hosts. Replaces this shell.
# (nsenter, not `ip netns exec`, which remounts /sys and so hides the cgroup file systems slurmd
# needs.) The source tree is the cluster's shared file system (as a build on NFS is): where it
# lies under /tmp it is bound back into the host's own /tmp at the same path (held at
# $STATE/shared while /tmp is replaced), so that a clone in /tmp runs there too.
in_host() {
  local i=$1 ns tmp hosts=$STATE/slurm/hosts shared="" keep=$STATE/shared
  shift
  ns=$(host_ns "$i")
  tmp=$STATE/h$i/tmp
  [ -d "$tmp" ] || tmp=""
  export TMPDIR=/tmp
  [ -f "$hosts" ] || hosts=""
  case $SOURCE_ROOT in /tmp/*) shared=$SOURCE_ROOT ;; esac
  exec nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private -- \
    sh -c 'hostname "$0" && { [ -z "$1" ] || mount --bind "$1" /etc/hosts; } &&
      if [ -n "$2" ]; then
        { [ -z "$3" ] || { mkdir -p "$4" && mount --bind "$3" "$4"; }; } && mount --bind "$2" /tmp &&
          { [ -z "$3" ] || { mkdir -p "$3" && mount --bind "$4" "$3"; }; }
      fi && shift 4 && exec "$@"' "$ns" "$hosts" "$tmp" "$shared" "$keep" "$@"
}

# slurm_cmd I command...: command on host I, in the cluster's environment (a subshell).
slurm_cmd() ( cluster_env; in_host "$@" )

# slurm_alive: slurmctld answers and no node is down.
slurm_alive() {
  local states
  states=$(timeout 10 bash "$SELF" exec 0 sinfo -h -N -o %T 2>/dev/null) || return 1
  [ -n "$states" ] && ! grep -qvE '^(idle|allocated|mixed|completing)$' <<<"$states"
}

# slurm_up H SLOTS: munged, slurmctld on host 0, a slurmd on every host; waits for every node idle.
slurm_up() {
  local hosts=$1 cpus=$2 s=$STATE/slurm i ns
  mkdir -p "$s/munge" "$s/ctld" && chmod 700 "$s/munge" || return 1
  head -c 1024 /dev/urandom >"$s/munge/munge.key" && chmod 400 "$s/munge/munge.key" || return 1
  # munged in the bridge's namespace (where `down` ends it), reached through its socket file.
  ip netns exec "$BR" munged --force --socket="$s/munge/socket" --key-file="$s/munge/munge.key" \
    --pid-file="$s/munge/munged.pid" --log-file="$s/munge/munged.log" --seed-file="$s/munge/seed" ||
    { echo "cluster.sh: munged did not start:" >&2; tail -5 "$s/munge/munged.log" >&2; return 1; }
  local cluster=${NAME,,}
  cluster=${cluster//[^a-z0-9_]/_}
  cat >"$s/slurm.conf" <<EOF
# Made by scripts/cluster.sh up --slurm for cluster '$NAME'; removed by cluster.sh down.
ClusterName=$cluster
SlurmctldHost=$(host_ns 0)($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$s/munge/socket
StateSaveLocation=$s/ctld
SlurmctldPidFile=$s/ctld/slurmctld.pid
SlurmctldLogFile=$s/ctld/slurmctld.log
SlurmdSpoolDir=$s/%n/spool
SlurmdPidFile=$s/%n/slurmd.pid
SlurmdLogFile=$s/%n/slurmd.log
SlurmdParameters=config_overrides
TmpFS=/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
# Short timeouts, so that a lost node is seen within seconds (defaults: 300, 120, 10, 30).
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
ReturnToService=2
MinJobAge=600
NodeName=$(host_ns 0) NodeAddr=$SUBNET.1 CPUs=$cpus State=UNKNOWN
EOF
  for ((i = 1; i < hosts; i++)); do
    echo "NodeName=$(host_ns "$i") NodeAddr=$SUBNET.$((i + 1)) CPUs=$cpus State=UNKNOWN" >>"$s/slurm.conf"
  done
  echo "PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$s/slurm.conf"
  # Every host sees the same /etc/hosts (every host's name and address).
  { printf '127.0.0.1\tlocalhost\n'; for ((i = 0; i < hosts; i++)); do printf '%s\t%s\n' "$SUBNET.$((i + 1))" "$(host_ns "$i")"; done; } >"$s/hosts"
  for ((i = 0; i < hosts; i++)); do
    mkdir -p "$s/h$i/spool" || return 1
    ln -sfn "h$i" "$s/$(host_ns "$i")"   # %n in slurm.conf is the node name
  done
  ( cluster_env; in_host 0 slurmctld -i ) ||
    { echo "cluster.sh: slurmctld did not start:" >&2; tail -5 "$s/ctld/slurmctld.log" >&2; return 1; }
  for ((i = 0; i < hosts; i++)); do
    ( cluster_env; in_host "$i" slurmd -N "$(host_ns "$i")" ) ||
      { echo "cluster.sh: slurmd on $(host_ns "$i") did not start:" >&2; tail -5 "$s/h$i/slurmd.log" >&2; return 1; }
  done
  local idle=0
  for _ in $(seq 60); do
    idle=$(slurm_cmd 0 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    [ "$idle" -eq "$hosts" ] && return 0
    sleep 0.5
  done
  echo "cluster.sh: $idle of $hosts Slurm nodes idle after 30 s:" >&2
  slurm_cmd 0 sinfo -N -l >&2
  tail -3 "$s/ctld/slurmctld.log" "$s"/h*/slurmd.log >&2
  return 1
}

cmd_exec() {
  [ $# -ge 2 ] || die "exec: expected HOST command... (e.g. exec $(host_ns 0) sinfo)" 2
  [ -f "$STATE/hostfile" ] || die "exec: cluster '$NAME' is not up; start it with: $0 up --slurm H"
  need_namespaces exec
  local i
  i=$(host_index "$1") || die "exec: '$1' is not a host of cluster '$NAME' ($(host_ns 0), h0, 0 or $SUBNET.1, ...)" 2
  shift
  cluster_env
  in_host "$i" "$@"
}

cmd_status() {
  if [ ! -f "$STATE/config" ]; then echo "cluster '$NAME' is not up"; return 0; fi
  echo "cluster '$NAME': $(cat "$STATE/config")"
  local ns
  for ns in $(our_namespaces); do
    [ "$ns" = "$BR" ] && continue
    echo "$ns: $(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}')  $(tc -n "$ns" qdisc show dev eth0 2>/dev/null | head -1)"
  done
}

[ $# -ge 1 ] || usage
command=$1
shift
case $command in
  up) cmd_up "$@" ;;
  run) cmd_run "$@" ;;
  exec) cmd_exec "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  agent) cmd_agent "$@" ;;
  -h | --help | help) usage ;;
  *) echo "cluster.sh: unknown command '$command'" >&2; usage ;;
esac
