#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (slurmctld + slurmd + munge, Debian's packages), to try the
# `hydra/launcher=slurm` path for real: .ci/run starts it and tests/test_slurm_cluster.py sweeps through it.
#
#   bash scripts/slurm_local.sh            # install (once, as root, apt-get) and start; idempotent
#   export SLURM_CONF=/tmp/luka_bench_slurm/slurm.conf   # then sbatch, squeue, sacct and
#                                          # hydra/launcher=slurm use this cluster
#   bash scripts/slurm_local.sh stop       # stop its daemons (munge stays)
#
# Everything (slurm.conf, slurmdbd.conf, state, spool, logs, the accounting database) lives in $LUKA_SLURM_DIR
# (default /tmp/luka_bench_slurm). The node is this host with its CPUs and 90 % of its memory; one partition,
# `debug`. Accounting (what `sacct`, submitit's job-state query, reads) is slurmdbd on a MariaDB instance of its
# own (in $LUKA_SLURM_DIR/db, on 127.0.0.1:3307), as on a real cluster.
set -euo pipefail

DIR="${LUKA_SLURM_DIR:-/tmp/luka_bench_slurm}"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"
say() { echo "slurm_local: $*" >&2; }
alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }
DB="$DIR/db"  # MariaDB's own folder (owned by its user): data/, its socket, pid and log

stop() {
    for p in slurmd slurmctld slurmdbd; do
        if alive "$p"; then
            kill "$(cat "$DIR/$p.pid")" && say "stopped $p"
        fi
    done
    if [ -f "$DB/mariadb.pid" ] && kill "$(cat "$DB/mariadb.pid")" 2>/dev/null; then say "stopped mariadbd"; fi
}

if [ "${1:-start}" = "stop" ]; then
    stop
    exit 0
fi

# 1. packages (quiet, only when missing)
need=()
for pair in slurmctld:slurmctld slurmd:slurmd slurmdbd:slurmdbd sbatch:slurm-client munged:munge \
    mariadbd:mariadb-server; do
    [ -x "/usr/sbin/${pair%%:*}" ] || [ -x "/usr/bin/${pair%%:*}" ] || need+=("${pair##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "needs ${need[*]} (Debian: apt-get install slurmctld slurmd slurmdbd slurm-client munge mariadb-server, as root)"
        exit 1
    fi
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
        apt-get update -q >/dev/null 2>&1
        apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
    }
fi

# 2. munge (authentication between the daemons and the clients). The munge client waits about a minute for a
#    missing socket, so look for the socket first.
munge_ok() { [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key && chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
fi

# 3. the accounting database: MariaDB (own datadir and port) and slurmdbd
mkdir -p "$DIR/state" "$DIR/spool"
db_alive() { [ -f "$DB/mariadb.pid" ] && kill -0 "$(cat "$DB/mariadb.pid")" 2>/dev/null; }
if ! db_alive; then
    mkdir -p "$DB" && chown mysql:mysql "$DB"
    if [ ! -d "$DB/data/mysql" ]; then
        rm -rf "$DB/data"
        mariadb-install-db --no-defaults --datadir="$DB/data" --user=mysql >"$DIR/mariadb-install.log" 2>&1
    fi
    setsid /usr/sbin/mariadbd --no-defaults --datadir="$DB/data" --socket="$DB/mariadb.sock" --port=3307 \
        --bind-address=127.0.0.1 --pid-file="$DB/mariadb.pid" --user=mysql --log-error="$DB/mariadb.log" \
        </dev/null >/dev/null 2>&1 &
    for _ in $(seq 150); do [ -S "$DB/mariadb.sock" ] && db_alive && break; sleep 0.2; done
    mariadb --no-defaults -S "$DB/mariadb.sock" -u root -e "
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
fi
if ! alive slurmdbd; then
    cat > "$DIR/slurmdbd.conf" <<EOF
# written by luka_bench's scripts/slurm_local.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/slurmdbd.conf"
    /usr/sbin/slurmdbd
    for _ in $(seq 100); do alive slurmdbd && (exec 3<>/dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.2; done
fi

# 4. slurm.conf for one node (this host), and the daemons
NODE="$(hostname -s)"
CPUS="$(nproc)"
MEM_MB="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
cat > "$CONF.new" <<EOF
# written by luka_bench's scripts/slurm_local.sh: a one-node cluster on $NODE
ClusterName=luka_bench
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
UnkillableStepTimeout=120
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$CONF.new" "$CONF" || ! { alive slurmctld && alive slurmd && scontrol ping 2>/dev/null | grep -q UP; }; then
    for p in slurmd slurmctld; do alive "$p" && kill "$(cat "$DIR/$p.pid")"; done
    for _ in $(seq 50); do alive slurmctld || alive slurmd || break; sleep 0.2; done
    mv "$CONF.new" "$CONF"
    /usr/sbin/slurmctld -f "$CONF"
    /usr/sbin/slurmd -f "$CONF"
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
else
    rm -f "$CONF.new"
fi

# 5. wait until the node takes jobs. A drain survives a restart (slurmctld keeps node state in $DIR/state): the
#    usual one here is "Kill task failed", a step that took longer than UnkillableStepTimeout to end after a SIGKILL
#    (the SLURM test kills a job on purpose; on a loaded machine that has been seen to take over a minute). Resume it,
#    as an administrator would, and say so.
state="" resumed=""
for _ in $(seq 150); do
    state="$(sinfo -h -N -o '%t' 2>/dev/null | head -1)"
    case "$state" in
        idle*|mix*|alloc*) break ;;
        drain*|drng*)
            [ -n "$resumed" ] && { sleep 0.2; continue; }
            resumed=1
            say "node $NODE was drained ($(sinfo -h -N -o '%E' 2>/dev/null | head -1)): resuming it"
            scontrol update NodeName="$NODE" State=RESUME || true ;;
    esac
    sleep 0.2
done
case "$state" in
    idle*|mix*|alloc*) say "up: node $(hostname -s) $state, partition debug (export SLURM_CONF=$CONF)" ;;
    *) say "node not ready (state '${state:-none}'); logs: $DIR/slurmctld.log, $DIR/slurmd.log"; exit 1 ;;
esac
