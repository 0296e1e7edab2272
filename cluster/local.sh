#!/usr/bin/env bash
# A local Ray cluster on this machine, with an S3 volume and an MLflow tracking server.
#
#   cluster/local.sh up [--workers N] [--cpus C] [--head-cpus H]
#       Start, in this order and each in a process group (session) of its own:
#         - an S3 server (SeaweedFS `weed mini`) on 127.0.0.1:8333 with one bucket,
#         - an MLflow tracking server on 127.0.0.1:5000 (SQLite database, proxied artifacts),
#         - a Ray head node (C CPUs, or H; default: all of the machine's) with token authentication,
#           its dashboard and job API on 127.0.0.1:8265 and fast node-failure detection,
#         - N worker nodes (default 0) of C CPUs each, one after the other.
#       Then print the addresses, the environment to export and an example `ray job submit`.
#   cluster/local.sh status          what runs (PIDs), the addresses, `ray status`
#   cluster/local.sh make-volume [N_PER_CLASS] [--classes K] [--size PX] [--prefix P] [--seed S]
#       Generate the shapes dataset into the bucket: P/train (N per class, default 200) and
#       P/val (N/4 per class, at least 10), K classes (default 4), PX pixels (default 32).
#   cluster/local.sh env             the environment to export (also in $STATE/env.sh)
#   cluster/local.sh example         the example `ray job submit` of jobs/train_images.py
#   cluster/local.sh down            stop exactly what `up` started (never `ray stop`)
#
# Settings (environment; `up` records them, the other commands use the recorded ones):
#   RAY_RESILIENT_CLUSTER_DIR     state: PIDs, logs, S3 data, MLflow database ($HOME/.ray_resilient/cluster)
#   RAY_RESILIENT_RAY_PORT        GCS port of the head (6379)
#   RAY_RESILIENT_DASHBOARD_PORT  dashboard and job API (8265)
#   RAY_RESILIENT_CLIENT_PORT     Ray Client server (10001)
#   RAY_RESILIENT_AGENT_PORT      the head's dashboard agent, which runs submitted jobs (52365)
#   RAY_RESILIENT_RAY_TEMP_DIR    the head's Ray temp dir (Ray's default, /tmp/ray; keep it short: socket
#                                 paths under it must fit in 107 characters); worker node i: <it>-worker-i
#   RAY_RESILIENT_S3_PORT         S3 (8333; SeaweedFS's other ports are free ones)
#   RAY_RESILIENT_MLFLOW_PORT     MLflow tracking server (5000)
#   RAY_RESILIENT_BUCKET          the bucket (ray-resilient; at least 3 characters)
#
# Every node runs `ray start --block` in its own session, so `down` stops this cluster's processes
# (the process groups it recorded, and every process descended from them, e.g. Ray's workers)
# without touching other Ray clusters on the machine, as `ray stop` would. Linux only (setsid, /proc).
# The S3 server, the readiness checks and the head's settings come from the test rig's command line
# (python -m ray_resilient.testing), which the tests and benchmarks use too.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
# Ray's processes, and so `python` in a job's entrypoint, use the project's environment.
VENV_BIN="$REPO/.venv/bin"
export PATH="$VENV_BIN:$PATH"
PY="$VENV_BIN/python"
STATE=${RAY_RESILIENT_CLUSTER_DIR:-$HOME/.ray_resilient/cluster}
SETTINGS="$STATE/cluster.env"
JOB_SCRIPT="jobs/train_images.py"
RIG=("$PY" -m ray_resilient.testing)
# The recorded settings' names (cluster.env): none comes from the caller's environment.
unset RAY_PORT DASHBOARD_PORT CLIENT_PORT AGENT_PORT RAY_TEMP_DIR S3_PORT MLFLOW_PORT BUCKET S3_ACCESS_KEY \
  S3_SECRET_KEY AWS_REGION_NAME

die() { echo "local.sh: $*" >&2; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

load_settings() {  # the recorded settings of the cluster, else the environment's, else the defaults
  if [[ -f $SETTINGS ]]; then
    # shellcheck disable=SC1090
    source "$SETTINGS"
  fi
  RAY_PORT=${RAY_PORT:-${RAY_RESILIENT_RAY_PORT:-6379}}
  DASHBOARD_PORT=${DASHBOARD_PORT:-${RAY_RESILIENT_DASHBOARD_PORT:-8265}}
  CLIENT_PORT=${CLIENT_PORT:-${RAY_RESILIENT_CLIENT_PORT:-10001}}
  AGENT_PORT=${AGENT_PORT:-${RAY_RESILIENT_AGENT_PORT:-52365}}
  RAY_TEMP_DIR=${RAY_TEMP_DIR-${RAY_RESILIENT_RAY_TEMP_DIR:-}}
  S3_PORT=${S3_PORT:-${RAY_RESILIENT_S3_PORT:-8333}}
  MLFLOW_PORT=${MLFLOW_PORT:-${RAY_RESILIENT_MLFLOW_PORT:-5000}}
  BUCKET=${BUCKET:-${RAY_RESILIENT_BUCKET:-ray-resilient}}
  S3_ACCESS_KEY=${S3_ACCESS_KEY:-ray-resilient}
  S3_SECRET_KEY=${S3_SECRET_KEY:-}
  AWS_REGION_NAME=${AWS_REGION_NAME:-us-east-1}
}

fresh_settings() {  # for `up`: the environment's settings (keeping the recorded S3 credentials)
  local secret=""
  if [[ -f $SETTINGS ]]; then
    secret=$(sed -n 's/^S3_SECRET_KEY=//p' "$SETTINGS")
  fi
  [[ -n $secret ]] || secret=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
  S3_SECRET_KEY=$secret
  SETTINGS=/dev/null load_settings
  ((${#BUCKET} >= 3)) || die "RAY_RESILIENT_BUCKET must have at least 3 characters, got '$BUCKET'"
}

client_env() {  # NAME=value words: what a client of the cluster (job CLI, boto, pyarrow, MLflow) needs
  echo "RAY_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT" "RAY_AUTH_MODE=token" \
       "MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT" \
       "AWS_ENDPOINT_URL=http://127.0.0.1:$S3_PORT" "AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY" \
       "AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY" "AWS_REGION=$AWS_REGION_NAME"
}

print_env() {
  echo "export RAY_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT RAY_AUTH_MODE=token"
  echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT"
  echo "export AWS_ENDPOINT_URL=http://127.0.0.1:$S3_PORT AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY" \
       "AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY AWS_REGION=$AWS_REGION_NAME"
}

print_example() {  # the example job: the shapes volume of `make-volume`, one injected worker kill
  cat <<EOF
ray job submit --working-dir . -- python $JOB_SCRIPT \\
    --volume s3://$BUCKET/shapes --storage-path s3://$BUCKET/runs --name shapes \\
    --min-workers 1 --max-workers 2 --interval 10 --faults kill:step=30:rank=1
EOF
}

# --- processes ---------------------------------------------------------------------------------

alive() {  # PID: running (a zombie is not)?
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ $stat != Z* ]]
}

pattern_of() {  # NAME: what the command line of that component's recorded PID contains
  case $1 in
    head | worker-*) echo "ray start" ;;
    s3) echo "ray_resilient.testing s3-server" ;;
    mlflow) echo "mlflow" ;;
  esac
}

recorded_pid() {  # NAME: the PID `up` recorded, if it still runs that component's command
  local file="$STATE/pids/$1.pid" pid
  [[ -f $file ]] || return 1
  pid=$(<"$file")
  alive "$pid" || return 1
  ps -o args= -p "$pid" | grep -q -- "$(pattern_of "$1")"
  echo "$pid"
}

components() {  # recorded components, in start order
  local name
  for name in s3 mlflow head; do
    [[ -f $STATE/pids/$name.pid ]] && echo "$name"
  done
  if compgen -G "$STATE/pids/worker-*.pid" >/dev/null; then
    ls "$STATE/pids" | sed -n 's/^\(worker-[0-9]*\)\.pid$/\1/p' | sort -t- -k2 -n
  fi
}

start_bg() {  # NAME CMD...: run CMD in a new session (its PID = its process group), log to logs/NAME.log
  local name=$1
  shift
  setsid "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$STATE/pids/$name.pid"
}

tree_of() {  # PID: the processes of PID's process group and all their descendants (Ray's workers
  # run in sessions of their own, but are children of the raylet)
  ps -eo pid=,ppid=,pgid= | awk -v root="$1" '
    { parent[$1] = $2; group[$1] = $3 }
    END {
      for (p in parent) if (p == root || group[p] == root) mark[p] = 1
      do {
        changed = 0
        for (p in parent) if (!(p in mark) && (parent[p] in mark)) { mark[p] = 1; changed = 1 }
      } while (changed)
      for (p in mark) print p
    }'
}

wait_gone() {  # SECONDS PID...: wait until none of the PIDs runs; false on timeout
  local deadline=$((SECONDS + $1)) pid left
  shift
  while :; do
    left=0
    for pid in "$@"; do
      if alive "$pid"; then left=1; break; fi
    done
    ((left)) || return 0
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

stop_component() {  # NAME: SIGTERM its process group and descendants; SIGKILL what is left after a grace
  # period (Ray's GCS may ignore SIGTERM, as LocalRayCluster found: 5 s for a Ray node)
  local name=$1 pid procs=() p grace=15
  [[ $name == s3 || $name == mlflow ]] || grace=5
  if pid=$(recorded_pid "$name"); then
    [[ $(ps -o pgid= -p "$pid" | tr -d ' ') == "$pid" ]] || die "$name (PID $pid) does not lead its process group"
    mapfile -t procs < <(tree_of "$pid")
    kill -TERM -- "-$pid" 2>/dev/null || true
    for p in "${procs[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    if ! wait_gone "$grace" "${procs[@]}"; then
      kill -KILL -- "-$pid" 2>/dev/null || true
      for p in "${procs[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
      wait_gone 5 "${procs[@]}" || echo "local.sh: some processes of $name survived SIGKILL: ${procs[*]}" >&2
    fi
    echo "stopped $name (PID $pid, ${#procs[@]} processes)"
  fi
  rm -f "$STATE/pids/$name.pid"
}

stop_all() {  # stop the workers (last started first), the head, then MLflow and S3
  local names=() i
  mapfile -t names < <(components)
  for ((i = ${#names[@]} - 1; i >= 0; i--)); do
    stop_component "${names[i]}"
  done
}

# --- readiness ---------------------------------------------------------------------------------

await() {  # WHAT TIMEOUT PID KIND ARGS...: wait until a service answers; fail if PID exits first
  # (KIND: http URL [BEARER_TOKEN_FILE], s3 ENDPOINT BUCKET, ray-nodes GCS_ADDRESS N; see `python -m
  # ray_resilient.testing --help`)
  local what=$1 timeout=$2 pid=$3
  shift 3
  if ! "${RIG[@]}" wait --pid "$pid" --timeout "$timeout" "$@"; then
    die "$what did not come up; see the end of its log:
$(tail -n 20 "$STATE/logs/$what.log" 2>/dev/null)"
  fi
}

port_taken() {  # PORT: does something accept connections on 127.0.0.1:PORT?
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# --- commands ----------------------------------------------------------------------------------

cmd_up() {
  local workers=0 cpus="" head_cpus="" name port i
  while (($#)); do
    case $1 in
      --workers) workers=${2:?--workers needs a number}; shift 2 ;;
      --workers=*) workers=${1#*=}; shift ;;
      --cpus) cpus=${2:?--cpus needs a number}; shift 2 ;;
      --cpus=*) cpus=${1#*=}; shift ;;
      --head-cpus) head_cpus=${2:?--head-cpus needs a number}; shift 2 ;;
      --head-cpus=*) head_cpus=${1#*=}; shift ;;
      [0-9]*) cpus=$1; shift ;;  # `up NUM_CPUS`, as before
      *) usage ;;
    esac
  done
  cpus=${cpus:-$(nproc)}
  head_cpus=${head_cpus:-$cpus}
  for n in "$workers" "$cpus" "$head_cpus"; do
    [[ $n =~ ^[0-9]+$ ]] || die "--workers, --cpus and --head-cpus take whole numbers, got '$n'"
  done
  [[ -x $VENV_BIN/ray && -x $VENV_BIN/weed && -x $VENV_BIN/mlflow ]] ||
    die "$VENV_BIN lacks ray, weed or mlflow: run scripts/setup.sh first"
  mkdir -p "$STATE/pids" "$STATE/logs"
  for name in $(components); do
    if recorded_pid "$name" >/dev/null; then
      die "a cluster from $STATE is up already ($name runs): cluster/local.sh status, or down first"
    fi
    rm -f "$STATE/pids/$name.pid"
  done
  rm -f "$STATE/pids/"worker-*.pid
  fresh_settings
  for port in "$RAY_PORT" "$DASHBOARD_PORT" "$CLIENT_PORT" "$AGENT_PORT" "$S3_PORT" "$MLFLOW_PORT"; do
    if port_taken "$port"; then
      die "port $port on 127.0.0.1 is taken (another cluster, a test's S3 server?): stop it, or choose other" \
          "ports with the RAY_RESILIENT_*_PORT variables (see cluster/local.sh --help)"
    fi
  done
  umask 077  # the settings hold the S3 secret
  cat >"$SETTINGS" <<EOF
RAY_PORT=$RAY_PORT
DASHBOARD_PORT=$DASHBOARD_PORT
CLIENT_PORT=$CLIENT_PORT
AGENT_PORT=$AGENT_PORT
RAY_TEMP_DIR=$RAY_TEMP_DIR
S3_PORT=$S3_PORT
MLFLOW_PORT=$MLFLOW_PORT
BUCKET=$BUCKET
S3_ACCESS_KEY=$S3_ACCESS_KEY
S3_SECRET_KEY=$S3_SECRET_KEY
AWS_REGION_NAME=$AWS_REGION_NAME
EOF
  print_env >"$STATE/env.sh"
  umask 022
  mkdir -p "$STATE/s3" "$STATE/mlflow/artifacts"
  # Whatever goes wrong from here on, stop what was started.
  trap 'echo "local.sh: up failed; stopping what it started" >&2; stop_all >&2' EXIT

  # The environment of every process started: the client environment (the nodes pass it on to
  # Ray's workers and to job drivers: S3 credentials, MLflow, token auth), no other cluster's address,
  # and this cluster's dashboard as the state API server: without it, Ray Train's PlacementGroupCleaner
  # looks for "the" local cluster and fails (or finds another one) when several run on the machine.
  # Fast node-failure detection: the GCS declares a lost node dead after ~3 s instead of ~15 s.
  local env_words fast_detection settings
  read -r -a env_words <<<"$(client_env)"
  settings=$("${RIG[@]}" fast-node-failure-env)
  mapfile -t fast_detection <<<"$settings"
  local node_env=(env -u RAY_ADDRESS "RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT" "${env_words[@]:1}"
                  "${fast_detection[@]}")

  start_bg s3 "${node_env[@]}" "${RIG[@]}" s3-server "$STATE/s3" --bucket "$BUCKET" --port "$S3_PORT" --timeout 120
  # MLflow's job runner (huey consumers: five processes) serves its GenAI jobs, which no run here uses.
  start_bg mlflow "${node_env[@]}" MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
    "$VENV_BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "sqlite:///$STATE/mlflow/mlflow.db" --artifacts-destination "$STATE/mlflow/artifacts"
  local temp_dir_arg=()
  [[ -z $RAY_TEMP_DIR ]] || temp_dir_arg=(--temp-dir="$RAY_TEMP_DIR")
  start_bg head "${node_env[@]}" "$VENV_BIN/ray" start --head --block --node-ip-address=127.0.0.1 \
    --port="$RAY_PORT" --num-cpus="$head_cpus" --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
    --ray-client-server-port="$CLIENT_PORT" --dashboard-agent-listen-port="$AGENT_PORT" --disable-usage-stats \
    "${temp_dir_arg[@]}"
  export RAY_AUTH_MODE=token
  await head 180 "$(<"$STATE/pids/head.pid")" ray-nodes "127.0.0.1:$RAY_PORT" 1
  await head 180 "$(<"$STATE/pids/head.pid")" http "http://127.0.0.1:$DASHBOARD_PORT/api/jobs/" "~/.ray/auth_token"
  # The worker nodes, one at a time (raylets starting together race for ports), each with a temp dir
  # of its own: nodes sharing one would share their runtime_resources, and a node unpacking a job's
  # working_dir would replace the directory a driver on another node runs in.
  for ((i = 1; i <= workers; i++)); do
    start_bg "worker-$i" "${node_env[@]}" "$VENV_BIN/ray" start --block --address="127.0.0.1:$RAY_PORT" \
      --node-ip-address=127.0.0.1 --num-cpus="$cpus" --disable-usage-stats \
      --temp-dir="${RAY_TEMP_DIR:-${TMPDIR:-/tmp}/ray}-worker-$i"
    await "worker-$i" 180 "$(<"$STATE/pids/worker-$i.pid")" ray-nodes "127.0.0.1:$RAY_PORT" $((i + 1))
  done
  AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY \
    await s3 120 "$(<"$STATE/pids/s3.pid")" s3 "127.0.0.1:$S3_PORT" "$BUCKET"
  await mlflow 180 "$(<"$STATE/pids/mlflow.pid")" http "http://127.0.0.1:$MLFLOW_PORT/health"
  trap - EXIT

  echo "Local cluster up (state and logs in $STATE):"
  echo "  Ray head      127.0.0.1:$RAY_PORT, $head_cpus CPUs; dashboard and job API http://127.0.0.1:$DASHBOARD_PORT"
  echo "                (token authentication: the token is in ~/.ray/auth_token)"
  for ((i = 1; i <= workers; i++)); do
    echo "  Ray worker $i  $cpus CPUs"
  done
  echo "  S3 volume     http://127.0.0.1:$S3_PORT, bucket $BUCKET (SeaweedFS; data in $STATE/s3)"
  echo "  MLflow        http://127.0.0.1:$MLFLOW_PORT (runs in $STATE/mlflow/mlflow.db)"
  echo
  echo "The environment of the job CLI, MLflow and S3 clients (also in $STATE/env.sh):"
  print_env | sed 's/^/  /'
  echo
  echo "A dataset on the S3 volume, then the job (from the repository's root):"
  echo "  cluster/local.sh make-volume"
  print_example | sed 's/^/  /'
  echo
  echo "Stop it all with: cluster/local.sh down"
}

cmd_status() {
  local name pid state=0
  if [[ ! -f $SETTINGS ]] || [[ -z $(components) ]]; then
    echo "no local cluster recorded in $STATE"
    return 1
  fi
  for name in $(components); do
    if pid=$(recorded_pid "$name"); then
      echo "$name: running (PID $pid)"
    else
      echo "$name: not running"
      state=1
    fi
  done
  echo "Ray job API http://127.0.0.1:$DASHBOARD_PORT, S3 http://127.0.0.1:$S3_PORT (bucket $BUCKET)," \
       "MLflow http://127.0.0.1:$MLFLOW_PORT"
  if recorded_pid head >/dev/null; then
    env -u RAY_ADDRESS RAY_AUTH_MODE=token "$VENV_BIN/ray" status --address="127.0.0.1:$RAY_PORT" || state=1
  fi
  return $state
}

cmd_make_volume() {
  local per_class=200 classes=4 size=32 prefix=shapes seed=0
  while (($#)); do
    case $1 in
      --per-class) per_class=${2:?}; shift 2 ;;
      --classes) classes=${2:?}; shift 2 ;;
      --size) size=${2:?}; shift 2 ;;
      --prefix) prefix=${2:?}; shift 2 ;;
      --seed) seed=${2:?}; shift 2 ;;
      [0-9]*) per_class=$1; shift ;;
      *) usage ;;
    esac
  done
  recorded_pid s3 >/dev/null || die "the S3 server is not running: cluster/local.sh up first"
  local env_words val_per_class=$((per_class / 4 > 10 ? per_class / 4 : 10))
  read -r -a env_words <<<"$(client_env)"
  env "${env_words[@]}" "$PY" jobs/make_image_volume.py "s3://$BUCKET/$prefix" --classes "$classes" \
    --per-class "$per_class" --val-per-class "$val_per_class" --size "$size" --seed "$seed"
  echo "the volume: --volume s3://$BUCKET/$prefix"
}

cmd_down() {
  if [[ ! -d $STATE/pids ]] || [[ -z $(components) ]]; then
    echo "no local cluster recorded in $STATE"
    return 0
  fi
  stop_all
  # `ray start` left Ray's address file naming this head in each node's temp dir; `ray.init()`
  # with no address follows it (and retries the dead head for minutes): remove what names it.
  local base=${RAY_TEMP_DIR:-${TMPDIR:-/tmp}/ray} pointer
  for pointer in "$base/ray_current_cluster" "$base"-worker-*/ray_current_cluster; do
    if [[ -f $pointer ]] && [[ $(<"$pointer") == *":$RAY_PORT" ]]; then
      rm -f "$pointer"
    fi
  done
  echo "Local cluster down (its data stays in $STATE)."
}

command=${1:-}
(($#)) && shift
case $command in
  up) cmd_up "$@" ;;
  down) load_settings; cmd_down ;;
  status) load_settings; cmd_status ;;
  make-volume) load_settings; cmd_make_volume "$@" ;;
  env) load_settings; print_env ;;
  example) load_settings; print_example ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
