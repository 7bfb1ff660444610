#!/usr/bin/env bash
# A multi-node job on one machine: NODES hosts, each a network namespace with its own address, hostname and
# torchrun agent, joined by veth cables to a switch (a bridge in one more namespace). torchrun's c10d
# rendezvous runs on host 0 exactly as on a cluster: a non-loopback address, node ranks, LOCAL_RANK != RANK,
# gloo over a real (virtual) NIC. Lesson: lessons/15-3d-parallelism.md ("Multi-node, run here").
#
#   bash scripts/local_cluster.sh NODES NPROC_PER_NODE [options] -- <nanomega/train.py flags>
#     --max-restarts N       torchrun restarts the workers up to N times after a failure (default 0)
#     --kill-node I@STEP     when the job has logged STEP, kill every process of host I (agent and workers);
#                            its agent is started again (as a cluster scheduler would), unless --elastic
#     --down-link I@STEP:S   when the job has logged STEP, take host I's cable down for S seconds
#     --slow-link I:RATE     host I's cable runs at RATE (tc's token bucket both ways, e.g. 50mbit) from the start
#     --elastic MIN          torchrun --nnodes MIN:NODES: a host lost for good (--kill-node with --elastic)
#                            leaves MIN..NODES-1 hosts that re-rendezvous and resume resharded
#     --rejoin STEP          with --elastic: the lost host comes back when the job has logged STEP (scale up)
#     --timeout S            kill the whole job after S seconds (default 900) and exit 124
#
# Exit code: the job's (0 when every agent still in the job exits 0); 77 with one line where namespaces
# cannot be made here (not root, no iproute2). Everything created (namespaces, /etc/netns entries,
# processes) is removed on exit, failure and Ctrl-C. Two runs at once do not collide: names carry a run id,
# and addresses and ports live inside each run's own namespaces (nothing is configured outside them).
# The addresses are 198.18.0.100+I (RFC 2544's benchmarking range), reachable only inside this run's switch.
set -uo pipefail

die() { echo "local_cluster: $*" >&2; exit 2; }
refuse() { echo "local_cluster: cannot make hosts here: $*" >&2; exit 77; }

[ $# -ge 2 ] || die "usage: local_cluster.sh NODES NPROC_PER_NODE [options] -- <train.py flags>"
NODES=$1 NPROC=$2
shift 2
[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "NODES must be 1..99, got '$NODES'"
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be >= 1, got '$NPROC'"
RESTARTS=0 KILL="" DOWN="" SLOW="" ELASTIC="" REJOIN="" TIMEOUT=900
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --max-restarts) RESTARTS=${2:?}; shift 2 ;;
    --kill-node) KILL=${2:?}; shift 2 ;;
    --down-link) DOWN=${2:?}; shift 2 ;;
    --slow-link) SLOW=${2:?}; shift 2 ;;
    --elastic) ELASTIC=${2:?}; shift 2 ;;
    --rejoin) REJOIN=${2:?}; shift 2 ;;
    --timeout) TIMEOUT=${2:?}; shift 2 ;;
    *) die "unknown option '$1' (options go before --, train.py flags after it)" ;;
  esac
done
[ "${1:-}" = "--" ] || die "missing '--' before the train.py flags"
shift
TRAIN=("$@")
[[ $RESTARTS =~ ^[0-9]+$ ]] || die "--max-restarts must be >= 0, got '$RESTARTS'"
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "--timeout must be seconds >= 1, got '$TIMEOUT'"
if [ -n "$KILL" ]; then
  [[ $KILL =~ ^([0-9]+)@([0-9]+)$ ]] || die "--kill-node '$KILL': expected HOST@STEP, e.g. 1@3"
  KILL_HOST=${BASH_REMATCH[1]} KILL_STEP=${BASH_REMATCH[2]}
  [ "$KILL_HOST" -ge 1 ] && [ "$KILL_HOST" -lt "$NODES" ] || die "--kill-node $KILL: host must be 1..$((NODES - 1)) (host 0 holds the rendezvous store; losing it ends the job)"
fi
if [ -n "$DOWN" ]; then
  [[ $DOWN =~ ^([0-9]+)@([0-9]+):([0-9]+)$ ]] || die "--down-link '$DOWN': expected HOST@STEP:SECONDS, e.g. 1@3:20"
  DOWN_HOST=${BASH_REMATCH[1]} DOWN_STEP=${BASH_REMATCH[2]} DOWN_S=${BASH_REMATCH[3]}
  [ "$DOWN_HOST" -ge 1 ] && [ "$DOWN_HOST" -lt "$NODES" ] || die "--down-link $DOWN: host must be 1..$((NODES - 1))"
fi
if [ -n "$SLOW" ]; then
  [[ $SLOW =~ ^([0-9]+):([0-9]+[kmg]?bit)$ ]] || die "--slow-link '$SLOW': expected HOST:RATE, e.g. 2:50mbit"
  SLOW_HOST=${BASH_REMATCH[1]} SLOW_RATE=${BASH_REMATCH[2]}
  [ "$SLOW_HOST" -lt "$NODES" ] || die "--slow-link $SLOW: host must be 0..$((NODES - 1))"
fi
NNODES=$NODES
if [ -n "$ELASTIC" ]; then
  [[ $ELASTIC =~ ^[0-9]+$ ]] && [ "$ELASTIC" -ge 1 ] && [ "$ELASTIC" -le "$NODES" ] || die "--elastic must be 1..NODES ($NODES), got '$ELASTIC'"
  NNODES="$ELASTIC:$NODES"
fi
if [ -n "$REJOIN" ]; then
  [[ $REJOIN =~ ^[0-9]+$ ]] && [ -n "$ELASTIC" ] && [ -n "$KILL" ] && [ "$REJOIN" -gt "$KILL_STEP" ] \
    || die "--rejoin STEP needs --elastic MIN, --kill-node I@STEP and a later STEP than the kill's"
fi
OUT=out  # the train.py --out-dir, whose metrics.jsonl tells which step the job has reached
for ((k = 0; k < ${#TRAIN[@]}; k++)); do
  case ${TRAIN[k]} in
    --out-dir) OUT=${TRAIN[k + 1]:-out} ;;
    --out-dir=*) OUT=${TRAIN[k]#--out-dir=} ;;
  esac
done

[ "$(id -u)" = 0 ] || refuse "network namespaces need root (run as root, or in CI which runs as root)"
command -v ip >/dev/null || refuse "iproute2's 'ip' is not installed (apt-get install -y iproute2)"
command -v unshare >/dev/null || refuse "util-linux's 'unshare' is not installed"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ID="nm$$x$RANDOM"           # this run's names: namespaces ${ID}h0.., ${ID}sw
SW="${ID}sw"
PORT=29400                   # the rendezvous port on host 0: private to this run's namespaces
NET=198.18.0
addr() { echo "$NET.$((100 + $1))"; }  # 100+I keeps the string order of addresses = host order (ranks)
START=$(date +%s.%N)
since() { awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "[cluster +$(since)s] $*" >&2; }

declare -a PIDS=()
cleanup() {
  trap - EXIT INT TERM
  for ((i = 0; i < NODES; i++)); do
    pids=$(ip netns pids "${ID}h$i" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  for ((i = 0; i < NODES; i++)); do
    ip netns del "${ID}h$i" 2>/dev/null
    rm -rf "/etc/netns/${ID}h$i"
  done
  ip netns del "$SW" 2>/dev/null
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

# the switch, then one host per node: a namespace, a veth cable (eth0 in the host, pI on the switch)
err=$(ip netns add "$SW" 2>&1) || refuse "'ip netns add' failed: $err"
ip -n "$SW" link add br0 type bridge && ip -n "$SW" link set br0 up || die "could not make the switch"
HOSTS=""
for ((i = 0; i < NODES; i++)); do HOSTS+="$(addr $i) node$i"$'\n'; done
for ((i = 0; i < NODES; i++)); do
  ns="${ID}h$i"
  ip netns add "$ns" || die "could not add namespace $ns"
  ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$SW" || die "could not cable host $i"
  ip -n "$SW" link set "p$i" master br0 up
  ip -n "$ns" addr add "$(addr $i)/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n%s' "$HOSTS" >"/etc/netns/$ns/hosts"  # ip netns exec mounts it on /etc/hosts
done
limit() {  # namespace, device: a token bucket on its way out
  err=$(ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$SLOW_RATE" burst 64kb latency 2s 2>&1) \
    || refuse "--slow-link: tc's token bucket (tbf) is not available here: $err"
}
if [ -n "$SLOW" ]; then  # both ends of the cable: host I sends and receives at RATE
  limit "$SW" "p$SLOW_HOST"
  limit "${ID}h$SLOW_HOST" eth0
fi

# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0's agent publishes a fresh MASTER_ADDR:PORT for the workers'
# store in every rendezvous round. With the shared agent store (torch's default) it is published only in
# the first round, so a host's agent started again after a loss waits for it forever (seen here, torch 2.13).
# No --node-rank: the c10d rendezvous ignores it and ranks the agents by their --local-addr (sorted strings),
# so host I gets node rank I and ranks I*NPROC..(I+1)*NPROC-1 -- TP groups stay inside a host.
start_host() {  # start host $1's torchrun agent in its namespace, with its own hostname
  local i=$1 is_host=0
  [ "$i" = 0 ] && is_host=1  # host 0 serves the rendezvous store (torchrun cannot tell from the address here)
  ip netns exec "${ID}h$i" unshare --uts bash -c 'hostname "$0" && exec "$@"' "node$i" \
    env GLOO_SOCKET_IFNAME=eth0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-$ROOT}" \
    python -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$(addr 0):$PORT" --rdzv-id "$ID" --local-addr "$(addr $i)" \
    --rdzv-conf "is_host=$is_host,last_call_timeout=5,join_timeout=300" --max-restarts "$RESTARTS" \
    "$ROOT/nanomega/train.py" "${TRAIN[@]}" > >(sed -u "s/^/[node$i] /") 2>&1 &
  PIDS[i]=$!
}

step_reached() {  # the last step the job has logged (0 before the first)
  local s
  s=$(tail -n 1 "$OUT/metrics.jsonl" 2>/dev/null | sed -n 's/.*"step": \([0-9][0-9]*\).*/\1/p')
  echo "${s:-0}"  # 0 also while a line is half written
}

say "$NODES hosts x $NPROC ranks: ${ID}h0..h$((NODES - 1)), addresses $(addr 0)..$(addr $((NODES - 1))), rendezvous $(addr 0):$PORT, nnodes $NNODES"
[ -n "$SLOW" ] && say "host $SLOW_HOST: its cable runs at $SLOW_RATE (tc tbf)"
for ((i = 0; i < NODES; i++)); do start_host "$i"; done

declare -A GONE=()  # hosts whose agent was killed on purpose (its exit code is not the job's)
killed=0 downed=0 deadline=$(( $(date +%s) + TIMEOUT ))
while :; do  # bounded by --timeout; polls every 0.2 s
  running=0
  for ((i = 0; i < NODES; i++)); do
    [ -z "${GONE[$i]:-}" ] && kill -0 "${PIDS[i]}" 2>/dev/null && running=1
  done
  [ "$running" = 0 ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    say "--timeout $TIMEOUT s reached: stopping every host"
    exit 124
  fi
  if [ -n "$KILL" ] && [ "$killed" = 0 ] && [ "$(step_reached)" -ge "$KILL_STEP" ]; then
    killed=1
    pids=$(ip netns pids "${ID}h$KILL_HOST")
    kill -9 $pids 2>/dev/null
    say "host $KILL_HOST lost at step $(step_reached): killed its agent and workers (pids $(echo $pids))"
    wait "${PIDS[KILL_HOST]}" 2>/dev/null
    if [ -n "$ELASTIC" ]; then
      GONE[$KILL_HOST]=1
      say "host $KILL_HOST is gone for good (--elastic $ELASTIC): the others go on without it"
    else
      start_host "$KILL_HOST"
      say "host $KILL_HOST: agent started again"
    fi
  fi
  if [ -n "$REJOIN" ] && [ -n "${GONE[$KILL_HOST]:-}" ] && [ "$(step_reached)" -ge "$REJOIN" ]; then
    unset "GONE[$KILL_HOST]"
    start_host "$KILL_HOST"
    say "host $KILL_HOST is back at step $(step_reached) (--rejoin $REJOIN): taken in at the next rendezvous"
  fi
  if [ -n "$DOWN" ] && [ "$downed" = 0 ] && [ "$(step_reached)" -ge "$DOWN_STEP" ]; then
    downed=1
    ip -n "$SW" link set "p$DOWN_HOST" down
    say "host $DOWN_HOST: link down at step $(step_reached) for $DOWN_S s"
    ( sleep "$DOWN_S"; ip -n "$SW" link set "p$DOWN_HOST" up && say "host $DOWN_HOST: link up" ) &
  fi
  sleep 0.2
done

rc=0
for ((i = 0; i < NODES; i++)); do
  [ -n "${GONE[$i]:-}" ] && continue
  wait "${PIDS[i]}"
  r=$?
  [ "$r" != 0 ] && [ "$rc" = 0 ] && rc=$r
done
# what crossed each host's cable (its eth0, counted by the kernel: payload + TCP/IP headers + the store)
for ((i = 0; i < NODES; i++)); do
  stats=/sys/class/net/eth0/statistics
  sent=$(ip netns exec "${ID}h$i" cat $stats/tx_bytes 2>/dev/null) got=$(ip netns exec "${ID}h$i" cat $stats/rx_bytes 2>/dev/null)
  say "host $i's cable: sent ${sent:-?} bytes, received ${got:-?} bytes"
done
say "job finished with exit code $rc"
exit "$rc"
