#!/usr/bin/env bash
# The README's Slurm sweep, run for real on this machine: a single-node Slurm (Debian's slurm-wlm and munge, as root)
# and a two-configuration sweep of tiny-llama on the smoke task through hydra/launcher=submitit_slurm.
#   sudo bash scripts/slurm_local.sh                  # about 2 minutes on 2 CPU cores; prints a report, exits 0 if the sweep checks out
#   KEEP=1 bash scripts/slurm_local.sh                # keep the temporary directory (config, logs, results) for a look
# Everything lives in one temporary directory: its own slurm.conf (SLURM_CONF, ports 16817/16818, so a system Slurm
# is left alone), state and logs, TOPTHETA_CACHE and results_dir. munged is started only when none runs, and every
# daemon this script started is stopped on exit. Checks: one stored run per configuration (k = 4 and k = 8), one
# dense baseline computed once for both jobs (the claims of toptheta/store/claims.py), every summary row present.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="${PYTHON:-python}"
[ "$(id -u)" = 0 ] || { echo "slurm_local.sh: run as root (slurmd and munged need it)" >&2; exit 1; }
for tool in slurmctld slurmd munged sbatch sinfo squeue; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || {
    echo "slurm_local.sh: $tool missing; apt-get install slurm-wlm munge" >&2; exit 1; }
done
"$PY" -c "import hydra_plugins.hydra_submitit_launcher" 2>/dev/null || {
  echo "slurm_local.sh: hydra-submitit-launcher missing; pip install -e '.[cluster]'" >&2; exit 1; }
export PATH="$PATH:/usr/sbin"

WORK=$(mktemp -d /tmp/toptheta-slurm.XXXXXX)
STARTED=()
cleanup() {
  for pid in "${STARTED[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${STARTED[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -z "${KEEP:-}" ]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
}
trap cleanup EXIT

# ---- munge: the default socket, which slurm's auth/munge uses ---------------------------------------------------
if ! munge -n >/dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || { /usr/sbin/mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown -R munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  /usr/sbin/munged --foreground --force >"$WORK/munged.log" 2>&1 &
  STARTED+=($!)
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null

# ---- slurm: one node, one partition, this machine's CPUs and memory ----------------------------------------------
NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/log"
export SLURM_CONF="$WORK/slurm.conf"
cat >"$SLURM_CONF" <<EOF
ClusterName=toptheta-local
SlurmctldHost=$NODE
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D -i -f "$SLURM_CONF" >"$WORK/log/slurmctld.out" 2>&1 &
STARTED+=($!)
slurmd -D -f "$SLURM_CONF" >"$WORK/log/slurmd.out" 2>&1 &
STARTED+=($!)
for _ in $(seq 100); do sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed)' && break; sleep 0.3; done
sinfo -h -o '%T' | grep -qE '^(idle|mixed)' || { echo "slurm did not come up:"; tail -20 "$WORK"/log/*; exit 1; }
echo "== slurm up: node $NODE, $CPUS CPUs, ${MEM_MB} MB, SLURM_CONF=$SLURM_CONF"
sinfo

# ---- the sweep: two configurations, one job each, sharing one dense baseline -------------------------------------
export TOPTHETA_CACHE="$WORK/cache"
RESULTS="$WORK/results"
COMMAND=("$PY" run.py -m hydra/launcher=submitit_slurm hydra.launcher.partition=local hydra.launcher.cpus_per_task=1
         hydra.launcher.mem_gb=3 hydra.launcher.timeout_min=20 "hydra.sweep.dir=$WORK/multirun"
         model=tiny-llama task=smoke task.limit=8 sparsifier=topk sparsifier.k=4,8 sparsifier.layer_k=null
         comp=vmc log_samples=false "results_dir=$RESULTS")
echo "== ${COMMAND[*]}"
T0=$(date +%s)
"${COMMAND[@]}" >"$WORK/sweep.log" 2>&1 || { echo "the sweep failed:"; tail -40 "$WORK/sweep.log";
  find "$WORK/multirun" -name '*.err' -exec tail -20 {} \; 2>/dev/null; exit 1; }
echo "== sweep finished in $(( $(date +%s) - T0 )) s"

# ---- the checks -------------------------------------------------------------------------------------------------
"$PY" - "$RESULTS" "$WORK/multirun" <<'EOF'
import json, sys
from pathlib import Path

import pandas as pd

results, sweep = Path(sys.argv[1]), Path(sys.argv[2])
runs = sorted(d for d in (results / "runs").iterdir() if (d / "DONE").is_file())
configs = {d.name: json.loads((d / "config.json").read_text()) for d in runs}
kinds = sorted((c["sparsifier"]["name"], c["sparsifier"]["k"]) for c in configs.values())
summary = pd.read_csv(results / "summary.csv")
hosts = {}
for d in runs:
    inv = json.loads((d / "invocation.json").read_text())
    hosts[d.name] = (inv.get("host"), inv.get("job"))
logs = sorted(p.name for p in sweep.rglob("*_log.out"))
print(f"stored runs: {len(runs)}")
for d in runs:
    c = configs[d.name]
    print(f"  {d.name}  {c['sparsifier']['name']:6} k={c['sparsifier']['k']}  job {hosts[d.name][1]} on {hosts[d.name][0]}")
print(summary[["run_id", "sparsifier", "k", "metric", "value", "kept_attention_fraction"]].to_string(index=False))
print(f"submitit job logs: {logs}")
problems = []
if kinds != [("dense", None), ("topk", 4), ("topk", 8)]:
    problems.append(f"expected one dense baseline and topk k=4, k=8, found {kinds}")
if sorted(set(summary["run_id"])) != sorted(configs):
    problems.append("summary.csv does not cover exactly the stored runs")
if summary.duplicated(["run_id", "task", "metric"]).any():
    problems.append("summary.csv has duplicate rows (a run computed twice?)")
if len(logs) != 2:
    problems.append(f"expected 2 submitit jobs, found logs {logs}")
print("CHECK:", "ok" if not problems else "FAILED: " + "; ".join(problems))
sys.exit(1 if problems else 0)
EOF
