#!/usr/bin/env bash
# A real two-node Kubernetes cluster on this machine, without Docker and without systemd, for
# running what pmem-csi ships as users run it (issue: real nodes). Network traffic stays on this
# machine: a host bridge and network namespaces this script creates.
#
#   host:    etcd, kube-apiserver, kube-controller-manager (all controllers), kube-scheduler,
#            all bound to 10.213.0.1 on the host bridge pmcsi0 (an address only this cluster owns,
#            so no port can collide with the random 127.0.0.1 ports of other tests).
#   node-N:  its own network namespace (/run/netns/realnode-node-N, veth into pmcsi0, 10.213.0.1N)
#            and its own mount namespace (/run/realnode/node-N.mnt) in which
#              /run              is a per-node dir  (containerd state + socket, shim sockets)
#              /var/log          is a per-node dir  (kubelet's /var/log/pods, /var/log/containers)
#              /var/lib/kubelet, /var/lib/pmem-csi.intel.com, /var/lib/pmem-csi-emulated
#                                are per-node dirs (the pmem-csi node DaemonSet's hostPaths)
#              /                 is rshared, as on a systemd host (mountPropagation: Bidirectional)
#              /sys              is a fresh sysfs of the node's netns, with the host's cgroup tree
#            running containerd, kubelet (cgroupRoot /realnode-node-N) and kube-proxy (nftables).
#            Pod network: CNI bridge cni0 in the node netns, pods in 10.214.N.0/24; the host routes
#            10.214.N.0/24 via the node IP so the apiserver reaches pod IPs.
#
# usage: tools/real-nodes.sh images | start | smoke | deploy | verify | scenarios | chart | status |
#                            stop | leftovers
#   images     the sidecar images as OCI archives (csi-provisioner from its static binary, the test
#              registrar of testenv with node-driver-registrar's flags), beside `just image-oci`'s
#   start      build PKI, start control plane and both nodes, wait until the nodes are Ready
#   smoke      run test pods on both nodes and fail unless: busybox reaches the apiserver through
#              the kubernetes Service, kubectl exec/logs work, privileged pods with Bidirectional
#              hostPaths as the pmem-csi node DaemonSet's propagate their mounts into the node, a
#              DaemonSet + Service answers (apiserver -> pod IP, pod -> ClusterIP -> both nodes),
#              and kubelet's plugin watcher sees a socket in plugins_registry
#   deploy     pmem-csi as a user installs it: import the images into both nodes' containerd,
#              label node-1 control-plane (the extender DaemonSet's nodeSelector), restart
#              kube-scheduler with manifests/scheduler/scheduler-config.yaml (extender URL on
#              node-1's IP, DNAT there to the extender's loopback listener), `kubectl apply -k` of
#              overlays/emulated + components/scheduler-extender with only an images: override,
#              and wait for every rollout
#   verify     fail unless: every pmem-csi container Ready with 0 restarts, each node's CSINode
#              lists the driver (kubelet's plugin watcher wrote it), capacity published, the pod
#              webhook mutated a pod through its Service, a late-binding claim written by one
#              busybox pod is read by a second, kubelet made the Node* calls, raw block, CSI inline
#              and generic ephemeral volumes work, and deleting it all leaves no PV and no volume
#   scenarios  the e2e crate in cluster mode against this cluster (tools/cluster-e2e.sh, as kind
#              runs it), then no volume left on any node
#   chart      remove the kustomize install (nothing may stay), `helm install` charts/pmem-csi with
#              the extender (only images set), `verify` again, a second instance (own driver name,
#              namespace, classes) provisioning beside it without touching the first, then both
#              uninstalled (with their namespaces) leaving nothing of ours
#   status     show processes, nodes, pods
#   stop       remove everything: processes, mounts, netns, links, routes, cgroups, files under
#              /run, restore the host's kernel settings, then fail if anything is left or any
#              of HOST_SYSCTLS differs from before start (the same check as `leftovers`)
#   leftovers  report what of the cluster is still there; exit status 1 if anything is
#
# Everything lives under $PMEM_CSI_REAL_NODES_DIR (default /tmp/pmem-csi-real-nodes: certs,
# configs, data, logs) and /run/realnode. Needs root, iproute2, nftables, openssl, and the tools
# of `just node-tools`.
set -euo pipefail

# ---------------------------------------------------------------------------------------------
# Layout and binaries
# ---------------------------------------------------------------------------------------------
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOP=${PMEM_CSI_REAL_NODES_DIR:-/tmp/pmem-csi-real-nodes}
S=$TOP/state                       # all runtime state; removed by stop
RUNDIR=/run/realnode               # namespace pin files (a private bind mount of itself)
SYSCTL_SAVED=$TOP/sysctl.saved      # HOST_SYSCTLS before start (kept by a failed stop)
# Host-wide kernel settings the cluster may change: our net.ipv4.ip_forward; kubelet's kernel
# tunables, which it writes at start without protectKernelDefaults (kernel.panic=10 and
# panic_on_oops=1 would make a later oops reboot the machine) and which protectKernelDefaults
# would instead refuse to start with; kube-proxy's conntrack and bridge settings (it runs in
# the nodes' network namespaces, but some of these are global).
HOST_SYSCTLS=(net.ipv4.ip_forward kernel.panic kernel.panic_on_oops vm.overcommit_memory
  vm.panic_on_oom kernel.keys.root_maxkeys kernel.keys.root_maxbytes
  net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established
  net.netfilter.nf_conntrack_tcp_timeout_close_wait net.ipv4.conf.all.route_localnet
  net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables)
K8S_BIN=$(bash "$here/build.sh" --print-dir)
NODE_BIN=$(bash "$here/node-tools.sh" --print-dir)
CNI_BIN=$(bash "$here/node-tools.sh" --print-cni-dir)
# Built with kubelet by `tools/build.sh --with-kubelet` (tools/node-tools.sh).
KUBE_PROXY=$K8S_BIN/kube-proxy
mapfile -t IMAGES < <(bash "$here/node-tools.sh" --print-images)

BRIDGE=pmcsi0
FORWARD_TABLE=realnode-forward     # nft table limiting forwarding to the cluster
HOST_IP=10.213.0.1
API_PORT=16443
API=https://$HOST_IP:$API_PORT
ETCD_PORT=2379                     # on 10.213.0.1 only
SERVICE_CIDR=10.0.0.0/24
CLUSTER_CIDR=10.214.0.0/16
NODES=(node-1 node-2)
node_ip()     { echo "10.213.0.1${1#node-}"; }     # node-1 -> 10.213.0.11
pod_subnet()  { echo "10.214.${1#node-}.0/24"; }    # node-1 -> 10.214.1.0/24
netns_name()  { echo "realnode-$1"; }
mntns_file()  { echo "$RUNDIR/$1.mnt"; }
# Per-node bind mounts inside each node's mount namespace (mount points created on the host if
# missing, and removed again by stop).
# (and those of the chart's second instance, charts/pmem-csi/ci/second-instance-values.yaml)
NODE_DIRS=(/var/lib/kubelet /var/lib/pmem-csi.intel.com /var/lib/pmem-csi-emulated
  /var/lib/second.pmem-csi.intel.com /var/lib/pmem-csi-second-emulated)
CG_HIERARCHIES=(cpu cpuacct cpuset memory devices freezer blkio pids systemd unified)

export PATH=$NODE_BIN:$K8S_BIN:$PATH   # containerd finds containerd-shim-runc-v2 on PATH
KUBECTL="$K8S_BIN/kubectl --kubeconfig=$S/pki/admin.kubeconfig"
kubectl_() { $KUBECTL "$@"; }

# fd 3 is the script's stderr, so that messages survive the probes' 2>/dev/null in wait_for
exec 3>&2
log() { printf '%s [%4ss] %s\n' "$(date +%T)" "$SECONDS" "$*" >&3; }
die() { log "ERROR: $*"; exit 1; }

# Starts a long-running process in its own session, records its pid, logs to $S/logs/<name>.log.
#   spawn <name> <cmd...>
spawn() {
  local name=$1; shift
  # 3>&-: fd 3 (the script's stderr) must not stay open in a daemon, or a caller piping our
  # output waits for it forever
  setsid "$@" >"$S/logs/$name.log" 2>&1 </dev/null 3>&- &
  echo $! >"$S/pids/$name"
  log "started $name (pid $!)"
}

# Runs a command inside node N's mount and network namespaces.
#   in_node <node> <cmd...>
in_node() {
  local n=$1; shift
  nsenter --mount="$(mntns_file "$n")" --net="/run/netns/$(netns_name "$n")" -- "$@"
}

# web_answers_node_1 <ip>: busybox-node-1 gets an answer from http://<ip>/ within 5 s.
web_answers_node_1() {
  $KUBECTL exec busybox-node-1 -- timeout 5 wget -qO- "http://$1/"
}

wait_for() { # wait_for <seconds> <description> <cmd...>
  local t=$1 what=$2; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || die "timeout after ${t}s waiting for $what"
    sleep 0.5
  done
  log "ready: $what"
}

# ---------------------------------------------------------------------------------------------
# PKI with openssl: one CA signs everything (also the kubelet client/serving side and CSRs).
# ---------------------------------------------------------------------------------------------
# cert <name> <CN> <O or ""> <extendedKeyUsage> [subjectAltName]
cert() {
  local name=$1 cn=$2 o=$3 eku=$4 san=${5:-} subj d=$S/pki
  subj="/CN=$cn"; [[ -n $o ]] && subj="/O=$o$subj"
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/$name.key" 2>/dev/null
  openssl req -new -key "$d/$name.key" -subj "$subj" -out "$d/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n $san ]] && echo "subjectAltName=$san"
  } >"$d/$name.ext"
  openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
    -days 30 -sha256 -extfile "$d/$name.ext" -out "$d/$name.crt" 2>/dev/null
  rm -f "$d/$name.csr" "$d/$name.ext"
}

# kubeconfig <name> <cert name> [server]
kubeconfig() {
  local name=$1 c=$2 server=${3:-$API} d=$S/pki
  cat >"$d/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: realnode
  cluster: {server: "$server", certificate-authority: "$d/ca.crt"}
users:
- name: $name
  user: {client-certificate: "$d/$c.crt", client-key: "$d/$c.key"}
contexts:
- name: realnode
  context: {cluster: realnode, user: $name}
current-context: realnode
EOF
}

make_pki() {
  local d=$S/pki
  mkdir -p "$d"
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$d/ca.key" -subj "/CN=realnode-ca" -days 30 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$d/ca.crt" 2>/dev/null
  cert apiserver kube-apiserver "" serverAuth \
    "IP:$HOST_IP,IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert admin admin system:masters clientAuth
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters clientAuth
  cert kcm system:kube-controller-manager "" clientAuth
  cert scheduler system:kube-scheduler "" clientAuth
  cert kube-proxy system:kube-proxy "" clientAuth
  local n
  for n in "${NODES[@]}"; do
    cert "$n" "system:node:$n" system:nodes clientAuth
    cert "$n-serving" "system:node:$n" system:nodes serverAuth "IP:$(node_ip "$n"),DNS:$n"
    kubeconfig "$n" "$n"
  done
  # front proxy (aggregation layer): its own CA, so that its client cert cannot act as a user
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/front-proxy-ca.key" 2>/dev/null
  openssl req -x509 -new -key "$d/front-proxy-ca.key" -subj "/CN=realnode-front-proxy-ca" -days 30 \
    -sha256 -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" -out "$d/front-proxy-ca.crt" 2>/dev/null
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/front-proxy-client.key" 2>/dev/null
  openssl req -new -key "$d/front-proxy-client.key" -subj "/CN=front-proxy-client" 2>/dev/null |
    openssl x509 -req -CA "$d/front-proxy-ca.crt" -CAkey "$d/front-proxy-ca.key" -CAcreateserial \
      -days 30 -sha256 -extfile <(echo "extendedKeyUsage=clientAuth") -out "$d/front-proxy-client.crt" 2>/dev/null
  # etcd: a CA of its own, so that no other certificate of the cluster (a node's) is accepted
  # by etcd's client-cert-auth.
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/etcd-ca.key" 2>/dev/null
  openssl req -x509 -new -key "$d/etcd-ca.key" -subj "/CN=realnode-etcd-ca" -days 30 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$d/etcd-ca.crt" 2>/dev/null
  local name eku
  for name in etcd-server etcd-client; do
    eku=serverAuth; [[ $name == etcd-client ]] && eku=clientAuth
    openssl ecparam -name prime256v1 -genkey -noout -out "$d/$name.key" 2>/dev/null
    openssl req -new -key "$d/$name.key" -subj "/CN=$name" 2>/dev/null |
      openssl x509 -req -CA "$d/etcd-ca.crt" -CAkey "$d/etcd-ca.key" -CAcreateserial -days 30 -sha256 \
        -extfile <(echo "extendedKeyUsage=$eku"; echo "subjectAltName=IP:$HOST_IP,IP:127.0.0.1") \
        -out "$d/$name.crt" 2>/dev/null
  done
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  kubeconfig admin admin
  kubeconfig kcm kcm
  kubeconfig scheduler scheduler
  kubeconfig kube-proxy kube-proxy
  log "pki written to $d"
}

# ---------------------------------------------------------------------------------------------
# Control plane
# ---------------------------------------------------------------------------------------------
# $TOP holds keys and what root runs: a directory someone else made (it is under /tmp by
# default) is refused, a new one is root's alone.
safe_top() {
  if [[ -L $TOP || (-e $TOP && ! -d $TOP) ]]; then die "$TOP is not a directory"; fi
  if [[ ! -d $TOP ]]; then mkdir -m 0700 "$TOP"; return; fi
  [[ $(stat -c %u "$TOP") == 0 ]] || die "$TOP is not owned by root: remove it or set PMEM_CSI_REAL_NODES_DIR"
  (( (8#$(stat -c %a "$TOP") & 8#022) == 0 )) || die "$TOP is writable by others: remove it"
  chmod 0700 "$TOP"
}

preflight() {
  safe_top
  [[ -e $S ]] && die "$S exists: run '$0 stop' first"
  ip link show "$BRIDGE" >/dev/null 2>&1 && die "link $BRIDGE exists: run '$0 stop' first"
  local b
  for b in "$KUBE_PROXY" "$K8S_BIN"/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kubelet} \
           "$NODE_BIN"/{containerd,containerd-shim-runc-v2,ctr,runc} "$CNI_BIN"/{bridge,host-local,loopback}; do
    [[ -x $b ]] || die "missing $b"
  done
  # 10.213.0.1 is ours alone, but check anyway that nothing listens on our ports on any address.
  if ss -Hltn | awk '{print $4}' | grep -Eq "(^|[:*])($API_PORT|$ETCD_PORT|2380|10257|10259)$"; then
    die "one of ports $API_PORT $ETCD_PORT 2380 10257 10259 is in use: $(ss -Hltnp | grep -E ":($API_PORT|$ETCD_PORT|2380|10257|10259) ")"
  fi
}

host_network() {
  ip link add "$BRIDGE" type bridge
  ip addr add "$HOST_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # A pod's packets to the other node's pods are routed by this host (pod subnet routes via the
  # node IPs below), which needs IPv4 forwarding; a fresh machine has it off, and then every
  # Service request that kube-proxy sends to the other node's endpoint times out. stop restores
  # the previous value (saved with HOST_SYSCTLS by start).
  sysctl -qw net.ipv4.ip_forward=1
  # ...but only for the cluster: its bridge and the nodes' veths forward among themselves;
  # nothing else crosses the bridge, and where forwarding was off before, nothing else is
  # forwarded at all (stop deletes the table).
  local ours="\"$BRIDGE\"" n others
  for n in "${NODES[@]}"; do ours+=", \"rn-$n\""; done
  others="iifname \"$BRIDGE\" drop; oifname \"$BRIDGE\" drop"
  grep -qx 'net.ipv4.ip_forward=0' "$SYSCTL_SAVED" && others=drop
  nft -f - <<EOF
table inet $FORWARD_TABLE {
  chain forward {
    type filter hook forward priority filter; policy accept;
    iifname { $ours } oifname { $ours } accept
    $others
  }
}
EOF
}

start_control_plane() {
  mkdir -p "$S/etcd"
  spawn etcd "$K8S_BIN/etcd" --name=realnode --data-dir="$S/etcd" \
    --listen-client-urls="https://$HOST_IP:$ETCD_PORT" --advertise-client-urls="https://$HOST_IP:$ETCD_PORT" \
    --cert-file="$S/pki/etcd-server.crt" --key-file="$S/pki/etcd-server.key" \
    --client-cert-auth --trusted-ca-file="$S/pki/etcd-ca.crt" \
    --listen-peer-urls="http://127.0.0.1:2380" --initial-advertise-peer-urls="http://127.0.0.1:2380" \
    --initial-cluster="realnode=http://127.0.0.1:2380" --unsafe-no-fsync=true --log-level=warn \
    --listen-metrics-urls=""
  local d=$S/pki
  wait_for 60 etcd curl -sf --cacert "$d/etcd-ca.crt" --cert "$d/etcd-client.crt" \
    --key "$d/etcd-client.key" "https://$HOST_IP:$ETCD_PORT/health"
  # Without a client certificate etcd refuses: the bridge address serves nobody else.
  if curl -sf --cacert "$d/etcd-ca.crt" "https://$HOST_IP:$ETCD_PORT/health" >/dev/null 2>&1; then
    die "etcd answers a client without a certificate"
  fi

  # Node,RBAC + NodeRestriction; ServiceAccount admission is on by default (projected tokens);
  # aggregator routing makes the apiserver dial webhook/APIService endpoints (pod IPs) directly.
  # GODEBUG=tlssha1=1: busybox's wget sends no signature_algorithms extension, which means SHA-1
  # signatures, refused since Go 1.25 (RFC 9155) -> "TLS error from peer (alert code 40)".
  # Only for the busybox check; real clients (rustls, client-go) do not need it.
  spawn kube-apiserver env GODEBUG=tlssha1=1 "$K8S_BIN/kube-apiserver" \
    --etcd-servers="https://$HOST_IP:$ETCD_PORT" --etcd-cafile="$d/etcd-ca.crt" \
    --etcd-certfile="$d/etcd-client.crt" --etcd-keyfile="$d/etcd-client.key" \
    --bind-address="$HOST_IP" --advertise-address="$HOST_IP" --secure-port="$API_PORT" \
    --tls-cert-file="$d/apiserver.crt" --tls-private-key-file="$d/apiserver.key" \
    --client-ca-file="$d/ca.crt" \
    --kubelet-client-certificate="$d/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$d/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$d/ca.crt" \
    --kubelet-preferred-address-types=InternalIP \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$d/sa.pub" --service-account-signing-key-file="$d/sa.key" \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --requestheader-client-ca-file="$d/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$d/front-proxy-client.crt" --proxy-client-key-file="$d/front-proxy-client.key" \
    --allow-privileged=true --enable-aggregator-routing=true --profiling=false
  wait_for 120 kube-apiserver kubectl_ get --raw /readyz

  spawn kube-controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig="$d/kcm.kubeconfig" --authentication-kubeconfig="$d/kcm.kubeconfig" \
    --authorization-kubeconfig="$d/kcm.kubeconfig" \
    --leader-elect=false --use-service-account-credentials=true --controllers='*' \
    --bind-address="$HOST_IP" --secure-port=10257 \
    --root-ca-file="$d/ca.crt" --service-account-private-key-file="$d/sa.key" \
    --cluster-signing-cert-file="$d/ca.crt" --cluster-signing-key-file="$d/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --allocate-node-cidrs=false --profiling=false
  spawn kube-scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig="$d/scheduler.kubeconfig" --authentication-kubeconfig="$d/scheduler.kubeconfig" \
    --authorization-kubeconfig="$d/scheduler.kubeconfig" \
    --leader-elect=false --bind-address="$HOST_IP" --secure-port=10259 --profiling=false
  wait_for 120 kube-controller-manager curl -skf "https://$HOST_IP:10257/healthz"
  wait_for 120 kube-scheduler curl -skf "https://$HOST_IP:10259/readyz"

  # kube-proxy's identity gets the bootstrap role kubeadm gives it.
  $KUBECTL create clusterrolebinding realnode:kube-proxy --clusterrole=system:node-proxier \
    --user=system:kube-proxy >/dev/null
}

# ---------------------------------------------------------------------------------------------
# Nodes
# ---------------------------------------------------------------------------------------------
node_network() { # <node>
  local n=$1 ns ip host_if
  ns=$(netns_name "$n"); ip=$(node_ip "$n"); host_if="rn-$n"
  ip netns add "$ns"
  ip link add "$host_if" type veth peer name eth0 netns "$ns"
  ip link set "$host_if" master "$BRIDGE" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$HOST_IP"
  ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1
  # The apiserver (and the other node) reach this node's pods through the node IP.
  ip route add "$(pod_subnet "$n")" via "$ip" dev "$BRIDGE"
}

# The node's mount namespace, pinned at $RUNDIR/<node>.mnt (the pin must be on a private mount,
# hence $RUNDIR is a private bind mount of itself). Entered together with the node's netns so that
# the fresh sysfs shows the node's own network devices.
node_mounts() { # <node>
  local n=$1 d
  d=$S/$n
  mkdir -p "$d"/{run,log,cgroup-move}
  touch "$(mntns_file "$n")"
  # shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
  nsenter --net="/run/netns/$(netns_name "$n")" -- \
    unshare --mount="$(mntns_file "$n")" --propagation private -- bash -euc '
      d=$1; shift
      mount --bind "$d/run" /run
      mount --bind "$d/log" /var/log
      # per-node state dirs (kubelet root, pmem-csi state and emulated PMEM): the two nodes share
      # the host root file system, so hostPaths outside these would be shared between them
      for p in "$@"; do
        mkdir -p "$d/dirs$p"
        mount --bind "$d/dirs$p" "$p"
      done
      # fresh sysfs of this netns, keeping the host cgroup tree at /sys/fs/cgroup
      mount --rbind /sys/fs/cgroup "$d/cgroup-move"
      mount -t sysfs sysfs /sys
      mount --move "$d/cgroup-move" /sys/fs/cgroup
      # like a systemd host: everything shared (inside this namespace only; the host does not
      # see these mounts), so mountPropagation Bidirectional works for any hostPath
      mount --make-rshared /
    ' _ "$d" "${NODE_DIRS[@]}"
}

# Per-node cgroup root in every v1 hierarchy (kubelet refuses a cgroupRoot that does not exist).
node_cgroups() { # <node>
  local n=$1 h
  for h in "${CG_HIERARCHIES[@]}"; do
    [[ -d /sys/fs/cgroup/$h ]] || continue
    mkdir -p "/sys/fs/cgroup/$h/realnode-$n"
  done
  # a new v1 cpuset has empty cpus/mems: copy the parent's
  cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/realnode-$n/cpuset.cpus"
  cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/realnode-$n/cpuset.mems"
}

node_configs() { # <node>
  local n=$1 d ip
  d=$S/$n
  ip=$(node_ip "$n")
  mkdir -p "$d/cni" "$d/containerd-root"
  # containerd 2.4, config version 3 (the default prints 4; 3 is still accepted and migrated).
  cat >"$d/containerd.toml" <<EOF
version = 3
root = "$d/containerd-root"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = 'registry.k8s.io/pause:3.10.2'
[plugins.'io.containerd.cri.v1.runtime']
  # no CAP_SYS_RESOURCE here: never lower a container's oom_score_adj below ours
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    BinaryName = "$NODE_BIN/runc"
    SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$d/cni"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
[plugins.'io.containerd.nri.v1.nri']
  disable = true
EOF
  cat >"$d/cni/10-realnode.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "realnode",
  "plugins": [
    {
      "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$d/cni-ipam",
        "ranges": [[{"subnet": "$(pod_subnet "$n")"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF
  cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 host, PID 1 is not systemd
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /realnode-$n
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $S/pki/$n-serving.crt
tlsPrivateKeyFile: $S/pki/$n-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $S/pki/ca.crt}
authorization: {mode: Webhook}
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
# imported images cannot be pulled again: never garbage-collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, imagefs.available: 2%, nodefs.inodesFree: 1%}
serializeImagePulls: false
# kubelet grows a claim in use (NodeExpandVolume) when it next syncs the pod: every 10 s instead
# of every minute keeps the expansion checks short.
syncFrequency: 10s
EOF
  cat >"$d/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $S/pki/kube-proxy.kubeconfig}
hostnameOverride: $n
mode: nftables
clusterCIDR: $CLUSTER_CIDR
detectLocalMode: ClusterCIDR
# nf_conntrack_max is read-only outside the initial netns: do not touch it
conntrack: {maxPerCore: 0, min: 0}
healthzBindAddress: $ip:10256
metricsBindAddress: 127.0.0.1:10249
EOF
}

start_node() { # <node>
  local n=$1 d
  d=$S/$n
  node_network "$n"
  node_mounts "$n"
  node_cgroups "$n"
  node_configs "$n"
  spawn "$n-containerd" nsenter --mount="$(mntns_file "$n")" --net="/run/netns/$(netns_name "$n")" -- \
    "$NODE_BIN/containerd" --config "$d/containerd.toml"
  wait_for 60 "$n containerd" test -S "$d/run/containerd/containerd.sock"
  local img
  for img in "${IMAGES[@]}"; do
    in_node "$n" "$NODE_BIN/ctr" -a /run/containerd/containerd.sock -n k8s.io images import \
      "${img%% *}" >>"$S/logs/$n-import.log" 2>&1
  done
  spawn "$n-kubelet" nsenter --mount="$(mntns_file "$n")" --net="/run/netns/$(netns_name "$n")" -- \
    "$K8S_BIN/kubelet" --config="$d/kubelet.yaml" --kubeconfig="$S/pki/$n.kubeconfig" \
    --hostname-override="$n" --node-ip="$(node_ip "$n")" --node-labels=storage=pmem --v=2
  spawn "$n-kube-proxy" nsenter --mount="$(mntns_file "$n")" --net="/run/netns/$(netns_name "$n")" -- \
    "$KUBE_PROXY" --config="$d/kube-proxy.yaml" --v=2
}

ds_ready() { [[ $($KUBECTL get ds "$1" -o jsonpath='{.status.numberReady}' 2>/dev/null) == "${#NODES[@]}" ]]; }
# Ready, or die at once (with the end of its log) when the node's kubelet or containerd is gone.
node_ready() {
  local p
  for p in kubelet containerd; do
    kill -0 "$(cat "$S/pids/$1-$p")" 2>/dev/null && continue
    tail -5 "$S/logs/$1-$p.log" >&3
    die "$1's $p exited (log: $S/logs/$1-$p.log)"
  done
  [[ $($KUBECTL get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}

# name=value of each of HOST_SYSCTLS the kernel has (net.netfilter.* only with conntrack
# loaded, net.bridge.* only with br_netfilter).
host_sysctls() {
  local k v
  for k in "${HOST_SYSCTLS[@]}"; do
    if v=$(sysctl -n "$k" 2>/dev/null); then printf '%s=%s\n' "$k" "${v//$'\t'/ }"; fi
  done
}

# Writes back the saved HOST_SYSCTLS, except those named as arguments.
restore_sysctls() {
  local line k
  [[ -e $SYSCTL_SAVED ]] || return 0
  while IFS= read -r line; do
    k=${line%%=*}
    [[ " $* " == *" $k "* ]] && continue
    [[ $(sysctl -n "$k" 2>/dev/null | tr '\t' ' ') == "${line#*=}" ]] && continue
    sysctl -qw "$k=${line#*=}" || log "could not restore $k"
  done <"$SYSCTL_SAVED"
}

# The HOST_SYSCTLS that differ from before start, one per line (empty: none).
changed_sysctls() {
  [[ -e $SYSCTL_SAVED ]] || return 0
  diff <(sort "$SYSCTL_SAVED") <(host_sysctls | sort) | grep '^[<>]' || true
}

start() {
  local t0=$SECONDS
  preflight
  # A saved set left by a failed stop holds the host's real values: keep it.
  [[ -e $SYSCTL_SAVED ]] || host_sysctls >"$SYSCTL_SAVED"
  mkdir -m 0700 "$S"
  mkdir -p "$S"/{pki,logs,pids} "$RUNDIR"
  mountpoint -q "$RUNDIR" || { mount --bind "$RUNDIR" "$RUNDIR"; mount --make-private "$RUNDIR"; }
  # the per-node dirs need mount points on the host; remember which ones we create
  local p
  for p in "${NODE_DIRS[@]}"; do
    [[ -d $p ]] || { mkdir "$p"; echo "$p" >>"$S/created-dirs"; }
  done
  make_pki
  host_network
  start_control_plane
  log "control plane up after $((SECONDS - t0))s"
  local n
  for n in "${NODES[@]}"; do start_node "$n"; done
  for n in "${NODES[@]}"; do wait_for 180 "node $n Ready" node_ready "$n"; done

  log "both nodes Ready $((SECONDS - t0))s after start"
  # kubelet wrote its kernel tunables once at start; the host keeps its own for the run (a
  # kernel oops must not reboot it), only forwarding stays on.
  restore_sysctls net.ipv4.ip_forward
  # pods are refused until the serviceaccount controller has made the namespace's "default"
  wait_for 60 "serviceaccount default/default" kubectl_ get serviceaccount default
  $KUBECTL get nodes -o wide
  echo "export KUBECONFIG=$S/pki/admin.kubeconfig"
}

# ---------------------------------------------------------------------------------------------
# Smoke test
# ---------------------------------------------------------------------------------------------
smoke() {
  local t0=$SECONDS n
  for n in "${NODES[@]}"; do
    cat <<EOF
apiVersion: v1
kind: Pod
metadata: {name: busybox-$n}
spec:
  nodeName: $n
  terminationGracePeriodSeconds: 1
  containers:
  - name: busybox
    image: $BUSYBOX_IMAGE
    imagePullPolicy: Never
    command: [sh, -c, 'echo hello from \$(hostname); exec sleep 100000']
---
EOF
  done | $KUBECTL apply -f - >/dev/null
  # Per node, a pod shaped like the pmem-csi node DaemonSet (manifests/base/node-daemonset.yaml +
  # overlays/emulated): privileged, an emptyDir, hostPaths /var/lib/kubelet/{pods,plugins/
  # kubernetes.io/csi,plugins_registry}, /var/lib/pmem-csi.intel.com (Bidirectional),
  # /var/lib/pmem-csi-emulated, /dev and /sys. The container mounts a tmpfs under the CSI dir and
  # one under the state dir, which must show up in the node's mount namespace.
  for n in "${NODES[@]}"; do
    cat <<EOF
apiVersion: v1
kind: Pod
metadata: {name: volumes-$n}
spec:
  nodeName: $n
  terminationGracePeriodSeconds: 1
  containers:
  - name: busybox
    image: $BUSYBOX_IMAGE
    imagePullPolicy: Never
    securityContext: {privileged: true}
    terminationMessagePath: /tmp/termination-log
    command:
    - sh
    - -c
    - |
      set -e
      for d in /var/lib/kubelet/plugins/kubernetes.io/csi/realnode-test /var/lib/pmem-csi.intel.com/realnode-test; do
        mkdir -p \$d && mount -t tmpfs realnode-test \$d
      done
      echo $n > /var/lib/pmem-csi-emulated/whoami
      echo mounted; exec sleep 100000
    volumeMounts:
    - {name: scratch, mountPath: /scratch}
    - {name: pods-dir, mountPath: /var/lib/kubelet/pods, mountPropagation: Bidirectional}
    - {name: csi-dir, mountPath: /var/lib/kubelet/plugins/kubernetes.io/csi, mountPropagation: Bidirectional}
    - {name: registry, mountPath: /registration}
    - {name: state-dir, mountPath: /var/lib/pmem-csi.intel.com, mountPropagation: Bidirectional}
    - {name: emulated-dir, mountPath: /var/lib/pmem-csi-emulated}
    - {name: dev-dir, mountPath: /dev}
    - {name: sys-dir, mountPath: /sys}
  volumes:
  - {name: scratch, emptyDir: {}}
  - {name: pods-dir, hostPath: {path: /var/lib/kubelet/pods, type: DirectoryOrCreate}}
  - {name: csi-dir, hostPath: {path: /var/lib/kubelet/plugins/kubernetes.io/csi, type: DirectoryOrCreate}}
  - {name: registry, hostPath: {path: /var/lib/kubelet/plugins_registry, type: Directory}}
  - {name: state-dir, hostPath: {path: /var/lib/pmem-csi.intel.com, type: DirectoryOrCreate}}
  - {name: emulated-dir, hostPath: {path: /var/lib/pmem-csi-emulated, type: DirectoryOrCreate}}
  - {name: dev-dir, hostPath: {path: /dev, type: Directory}}
  - {name: sys-dir, hostPath: {path: /sys, type: Directory}}
---
EOF
  done | $KUBECTL apply -f - >/dev/null
  for n in "${NODES[@]}"; do
    $KUBECTL wait --for=condition=Ready "pod/busybox-$n" "pod/volumes-$n" --timeout=120s
  done
  log "test pods Ready $((SECONDS - t0))s after apply"
  $KUBECTL get pods -o wide
  local out
  for n in "${NODES[@]}"; do
    out=$($KUBECTL exec "busybox-$n" -- wget -qO- --no-check-certificate https://10.0.0.1/version) ||
      die "busybox-$n cannot reach the apiserver through the kubernetes Service 10.0.0.1:443"
    grep -q '"gitVersion"' <<<"$out" || die "busybox-$n: no version from the apiserver: $out"
    log "busybox-$n reaches the apiserver through the kubernetes Service"
    $KUBECTL logs "busybox-$n" | grep -q "hello from busybox-$n" || die "kubectl logs busybox-$n"
  done
  for n in "${NODES[@]}"; do
    [[ $(in_node "$n" grep -c realnode-test /proc/self/mountinfo) == 2 ]] ||
      die "the Bidirectional mounts of volumes-$n did not propagate into $n's mount namespace"
    [[ $(in_node "$n" cat /var/lib/pmem-csi-emulated/whoami) == "$n" ]] ||
      die "$n's emulated directory is not its own"
    [[ ! -e /var/lib/pmem-csi-emulated/whoami ]] || die "$n's emulated directory leaked to the host"
    log "volumes-$n: Bidirectional mounts propagated, per-node hostPaths"
  done
  # A DaemonSet (as pmem-csi's node part) of busybox httpd on 8080 behind a Service "web" on 80:
  #  - apiserver -> pod IP directly (pods/proxy), the path of webhooks with aggregator routing
  #  - apiserver -> Service (services/proxy picks an endpoint itself)
  #  - pod on node-1 -> Service ClusterIP -> pods on both nodes (kube-proxy, cross-node routing)
  cat <<EOF | $KUBECTL apply -f - >/dev/null
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: web}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      nodeSelector: {storage: pmem}
      terminationGracePeriodSeconds: 1
      containers:
      - name: httpd
        image: $BUSYBOX_IMAGE
        imagePullPolicy: Never
        command: [sh, -c, 'mkdir -p /www && hostname > /www/index.html && exec httpd -f -p 8080 -h /www']
        ports: [{containerPort: 8080}]
        readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 2}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
EOF
  wait_for 120 "DaemonSet web ready on both nodes" ds_ready web
  local pod
  for pod in $($KUBECTL get pods -l app=web -o name); do
    # The path of admission webhooks with aggregator routing: the apiserver dials the pod IP.
    out=$($KUBECTL get --raw "/api/v1/namespaces/default/pods/${pod#pod/}:8080/proxy/") ||
      die "the apiserver cannot reach ${pod#pod/} at its pod IP"
    [[ $out == "${pod#pod/}" ]] || die "${pod#pod/} answered $out"
  done
  log "the apiserver reaches pod IPs on both nodes"
  local ip answers=""
  ip=$($KUBECTL get svc web -o jsonpath='{.spec.clusterIP}')
  # kube-proxy programs a new Service's rules on its next sync after the EndpointSlice appears;
  # on a loaded machine the first request can come before that (seen: one timeout, then every
  # answer). Wait for the first answer, then require all eight.
  wait_for 60 "Service web ($ip) programmed on node-1" web_answers_node_1 "$ip"
  # Eight requests, then more until every endpoint has answered (kube-proxy picks at random;
  # an endpoint on the other node that never answers is cross-node routing broken).
  local pods missing i
  pods=$($KUBECTL get pods -l app=web -o name)
  for i in $(seq 32); do
    # (busybox 1.35's wget -T segfaults: exit 139; hence timeout(1))
    answers+="$($KUBECTL exec busybox-node-1 -- timeout 5 wget -qO- "http://$ip/" 2>&1 || echo FAILED) "
    [[ $answers != *FAILED* ]] || die "busybox-node-1 -> Service web ($ip:80): $answers"
    missing=""
    for pod in $pods; do
      [[ $answers == *"${pod#pod/}"* ]] || missing+=" ${pod#pod/}"
    done
    ((i >= 8)) && [[ -z $missing ]] && break
  done
  [[ -z $missing ]] || die "Service web: never answered by$missing in 32 requests ($answers)"
  log "busybox-node-1 -> Service web ($ip:80) answered by: $answers"
  # kubelet's plugin watcher: a Unix socket appearing in node-1's /var/lib/kubelet/plugins_registry
  # must be picked up (it answers no gRPC, so registration fails; we only look for the attempt)
  in_node node-1 timeout 8 python3 -c '
import socket, time
s = socket.socket(socket.AF_UNIX)
s.bind("/var/lib/kubelet/plugins_registry/realnode-test-reg.sock"); s.listen(5); time.sleep(7)
' &
  local pw=$!
  wait_for 6 "kubelet's plugin watcher to see a socket in plugins_registry" \
    grep -q 'realnode-test-reg.sock' "$S/logs/node-1-kubelet.log"
  wait "$pw" || true
  in_node node-1 rm -f /var/lib/kubelet/plugins_registry/realnode-test-reg.sock
  # Nothing of the smoke test stays for what runs next.
  $KUBECTL delete ds/web svc/web --wait=true --timeout=60s >/dev/null
  $KUBECTL delete pod --all --wait=true --timeout=60s >/dev/null
  for n in "${NODES[@]}"; do in_node "$n" rm -f /var/lib/pmem-csi-emulated/whoami; done
  log "smoke test passed in $((SECONDS - t0))s"
}

status() {
  local f
  for f in "$S"/pids/*; do
    [[ -e $f ]] || continue
    printf '%-24s pid %-7s %s\n' "$(basename "$f")" "$(cat "$f")" \
      "$(kill -0 "$(cat "$f")" 2>/dev/null && echo running || echo DEAD)"
  done
  $KUBECTL get nodes -o wide 2>/dev/null || true
  $KUBECTL get pods -A -o wide 2>/dev/null || true
}

# ---------------------------------------------------------------------------------------------
# pmem-csi: images, scheduler extender wiring, the shipped manifests
# ---------------------------------------------------------------------------------------------
REPO=$(cd "$here/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
IMAGES_DIR=$TOP/images
PMEM_ARCHIVE=$TARGET/pmem-csi.oci.tar
PROVISIONER_IMAGE=localhost/csi-provisioner:v6.3.0
RESIZER_IMAGE=localhost/csi-resizer:v2.3.0
REGISTRAR_IMAGE=localhost/csi-node-driver-registrar:pmem-csi-test
BUSYBOX_IMAGE=localhost/busybox:pmem-csi-e2e
DEPLOY_ARCHIVES=("$PMEM_ARCHIVE" "$IMAGES_DIR/csi-provisioner.oci.tar" "$IMAGES_DIR/csi-resizer.oci.tar"
  "$IMAGES_DIR/registrar.oci.tar")
# The node standing in for "the control-plane node": the extender DaemonSet runs there.
EXTENDER_NODE="node-1"
EXTENDER_PORT=10013

# shellcheck source=tools/oci-archive.sh
source "$here/oci-archive.sh"
# shellcheck source=tools/libraries.sh
source "$here/libraries.sh"

images() {
  mkdir -p "$IMAGES_DIR"
  local work
  work=$(mktemp -d "$IMAGES_DIR/.work.XXXXXX")
  # csi-provisioner: static (CGO_ENABLED=0), nothing but the binary and a /tmp.
  mkdir -p "$work/prov/tmp"; chmod 1777 "$work/prov/tmp"
  install -m 0755 "$K8S_BIN/csi-provisioner" "$work/prov/csi-provisioner"
  oci_archive "$work/prov" "$PROVISIONER_IMAGE" '{"Entrypoint":["/csi-provisioner"]}' \
    "$IMAGES_DIR/csi-provisioner.oci.tar"
  # csi-resizer: static as well.
  mkdir -p "$work/resizer/tmp"; chmod 1777 "$work/resizer/tmp"
  install -m 0755 "$K8S_BIN/csi-resizer" "$work/resizer/csi-resizer"
  oci_archive "$work/resizer" "$RESIZER_IMAGE" '{"Entrypoint":["/csi-resizer"]}' \
    "$IMAGES_DIR/csi-resizer.oci.tar"
  # The registrar (testenv/src/registrar.rs; node-driver-registrar is not served by the Go module
  # proxy): the debug build, stripped, with the libraries and loader ldd resolves.
  local reg=$TARGET/debug/registrar
  [[ -x $reg ]] || die "$reg missing: cargo build -p testenv --bin registrar"
  mkdir -p "$work/reg/tmp"; chmod 1777 "$work/reg/tmp"
  strip -o "$work/reg/registrar" "$reg"
  copy_libraries "$reg" "$work/reg" || die "libraries of the registrar"
  oci_archive "$work/reg" "$REGISTRAR_IMAGE" '{"Entrypoint":["/registrar"]}' \
    "$IMAGES_DIR/registrar.oci.tar"
  rm -rf "$work"
  log "images: $PROVISIONER_IMAGE, $RESIZER_IMAGE, $REGISTRAR_IMAGE in $IMAGES_DIR"
}

# The extender listens on 127.0.0.1:10013 of its node (hostNetwork; it refuses any other
# address), but kube-scheduler runs in the host's netns. In the node's netns, connections to
# <node IP>:10013 are DNATed to 127.0.0.1:10013 (route_localnet allows a loopback destination for
# packets from eth0); the table goes with the netns.
extender_dnat() { # <node>
  local n=$1
  in_node "$n" sysctl -qw net.ipv4.conf.eth0.route_localnet=1
  in_node "$n" nft -f - <<EOF
table ip realnode-extender {
  chain prerouting {
    type nat hook prerouting priority dstnat; policy accept;
    iifname "eth0" tcp dport $EXTENDER_PORT dnat to 127.0.0.1:$EXTENDER_PORT
  }
}
EOF
}

# kube-scheduler again, now with the shipped KubeSchedulerConfiguration; only the kubeconfig
# path, the extender's URL (node IP instead of loopback) and leader election are changed.
scheduler_with_extender() {
  local d=$S/pki cfg=$S/scheduler-config.yaml pid
  sed -e "s|kubeconfig: /etc/kubernetes/scheduler.conf|kubeconfig: $d/scheduler.kubeconfig|" \
      -e "s|urlPrefix: http://127.0.0.1:$EXTENDER_PORT|urlPrefix: http://$(node_ip "$EXTENDER_NODE"):$EXTENDER_PORT|" \
      "$REPO/manifests/scheduler/scheduler-config.yaml" >"$cfg"
  printf 'leaderElection:\n  leaderElect: false\n' >>"$cfg"
  grep -q "urlPrefix: http://$(node_ip "$EXTENDER_NODE")" "$cfg" || die "scheduler-config.yaml: no urlPrefix to rewrite"
  pid=$(pidof_ours kube-scheduler)
  kill_wait TERM "$pid"
  spawn kube-scheduler "$K8S_BIN/kube-scheduler" --config="$cfg" \
    --authentication-kubeconfig="$d/scheduler.kubeconfig" --authorization-kubeconfig="$d/scheduler.kubeconfig" \
    --bind-address="$HOST_IP" --secure-port=10259 --profiling=false --v=2
  wait_for 60 "kube-scheduler with the extender config" curl -skf "https://$HOST_IP:10259/readyz"
}

deploy() {
  local t0=$SECONDS t n a
  for a in "${DEPLOY_ARCHIVES[@]}"; do [[ -f $a ]] || die "missing image archive $a"; done
  t=$SECONDS
  for n in "${NODES[@]}"; do
    for a in "${DEPLOY_ARCHIVES[@]}"; do
      in_node "$n" "$NODE_BIN/ctr" -a /run/containerd/containerd.sock -n k8s.io images import "$a" \
        >>"$S/logs/$n-import.log" 2>&1 || { tail -3 "$S/logs/$n-import.log" >&3; die "import of $a into $n failed"; }
    done
  done
  log "images imported into both nodes in $((SECONDS - t))s"
  $KUBECTL label node "$EXTENDER_NODE" node-role.kubernetes.io/control-plane= --overwrite >/dev/null
  extender_dnat "$EXTENDER_NODE"
  scheduler_with_extender
  t=$SECONDS
  # What a user writes (tools/cluster-e2e.sh, shared with kind): only the images are changed,
  # imported instead of pulled.
  KUBECTL=$KUBECTL bash "$here/cluster-e2e.sh" deploy "$S/deploy" \
    ghcr.io/pmem-csi/pmem-csi=localhost/pmem-csi:dev \
    "registry.k8s.io/sig-storage/csi-provisioner=$PROVISIONER_IMAGE" \
    "registry.k8s.io/sig-storage/csi-resizer=$RESIZER_IMAGE" \
    "registry.k8s.io/sig-storage/csi-node-driver-registrar=$REGISTRAR_IMAGE" ||
    die "deploying pmem-csi"
  log "pmem-csi: all rollouts done $((SECONDS - t))s after apply ($((SECONDS - t0))s with imports)"
}

# A busybox pod on claim <claim> running <script> (then sleeping).
data_pod() { # <name> <claim> <script>
  cat <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: $BUSYBOX_IMAGE
    imagePullPolicy: Never
    command: [sh, -c, '$3 && exec sleep 1000000']
    volumeMounts: [{name: data, mountPath: /data}]
  volumes:
  - name: data
    persistentVolumeClaim: {claimName: $2}
EOF
}

# A ReadWriteOnce claim <name> asking for <size> of class <class>.
apply_claim() { # <name> <size> <class>
  $KUBECTL apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: $2}}
  storageClassName: $3
EOF
}
# Claim <name> asks for <size> now (a growth, as an operator asks for it).
ask_for() { # <name> <size>
  $KUBECTL patch pvc "$1" --type merge -p "{\"spec\":{\"resources\":{\"requests\":{\"storage\":\"$2\"}}}}" >/dev/null
}

no_pvs() { [[ -z $($KUBECTL get pv -o name 2>/dev/null) ]]; }
# After <what>: no PV, and no volume or state file on any node.
no_volume_left() { # <what>
  local n out
  wait_for 90 "every PV gone after $1" no_pvs
  for n in "${NODES[@]}"; do
    out=$(in_node "$n" find /var/lib/pmem-csi-emulated /var/lib/pmem-csi.intel.com -type f)
    [[ -z $out ]] || die "volumes left on $n after $1: $out"
  done
}
csinode_lists_driver() { $KUBECTL get csinode "$1" -o jsonpath='{.spec.drivers[*].name}' | grep -qw pmem-csi.intel.com; }
capacity_of() { $KUBECTL -n pmem-csi get csistoragecapacities -o name | grep -q "pmem-csi-$1-"; }
# The node's heartbeat Lease, held by the node: written with kubelet's pod-bound token, which
# the Lease policy (manifests/base/node-lease-policy.yaml) requires to name this node.
heartbeat_of() {
  [[ $($KUBECTL -n pmem-csi get lease "pmem-csi-intel-com-node-$1" -o jsonpath='{.spec.holderIdentity}' 2>/dev/null) == "$1" ]]
}

# A Kubernetes quantity in bytes (plain, or with a decimal or binary suffix); %.0f, since mawk's
# %d stops at 2^31 - 1.
bytes_of() { # <quantity>
  awk -v q="$1" 'BEGIN {
    n = q; sub(/[A-Za-z]+$/, "", n); u = substr(q, length(n) + 1)
    f["k"] = 1e3; f["M"] = 1e6; f["G"] = 1e9; f["T"] = 1e12
    f["Ki"] = 2^10; f["Mi"] = 2^20; f["Gi"] = 2^30; f["Ti"] = 2^40
    printf "%.0f\n", n * (u == "" ? 1 : f[u])
  }'
}
# The bytes node <node> publishes as free for class <class>.
published_free() { # <node> <class>
  local q
  q=$($KUBECTL -n pmem-csi get csistoragecapacity "pmem-csi-$1-$2" -o jsonpath='{.capacity}') || return 1
  bytes_of "$q"
}
claim_capacity_is() { # <claim> <quantity>
  [[ $($KUBECTL get pvc "$1" -o jsonpath='{.status.capacity.storage}') == "$2" ]]
}
published_free_is() { # <node> <class> <bytes>
  [[ $(published_free "$1" "$2") == "$3" ]]
}
# Total KiB of the file system a pod sees at /data.
data_kib() { # <pod>
  $KUBECTL exec "$1" -- df -k /data | awk 'NR == 2 {print $2}'
}
# Whether the Events of <claim> or <pod>, or the claim's conditions (kubelet reports a refused
# growth as NodeResizeError there), say <text>.
reported() { # <claim> <pod> <text>
  local o
  for o in "$1" "$2"; do
    $KUBECTL get events --field-selector "involvedObject.name=$o" -o jsonpath='{.items[*].message}' | grep -qF "$3" &&
      return 0
  done
  $KUBECTL get pvc "$1" -o jsonpath='{.status.conditions[*].message}' | grep -qF "$3"
}

# Volume expansion as an operator does it (`kubectl patch` of a claim in use): csi-resizer in the
# controller Deployment leaves the growth to the node, kubelet calls NodeExpandVolume there. An
# xfs claim grows under its running pod, which sees the new size at once and keeps its data; the
# node's published capacity drops by the growth. A growth beyond the node's room is refused with
# the driver's message and changes nothing. ext4 cannot grow online on this machine (its sandbox
# has no CAP_SYS_RESOURCE): the events say so.
expansion() {
  local t0=$SECONDS node before free uid kib managed
  apply_claim grow-xfs 320Mi pmem-csi-sc-xfs
  data_pod grower grow-xfs 'echo kept > /data/kept && sync' | $KUBECTL apply -f - >/dev/null
  $KUBECTL wait --for=condition=Ready pod/grower --timeout=120s >/dev/null || die "grower not Ready"
  node=$($KUBECTL get pod grower -o jsonpath='{.spec.nodeName}')
  uid=$($KUBECTL get pod grower -o jsonpath='{.metadata.uid}')
  before=$(data_kib grower)
  # The claim's volume is the only one on the node: what it publishes as free follows from the
  # region's size (no other volume is left by the checks before, see no_volume_left).
  managed=$($KUBECTL -n pmem-csi get csistoragecapacity "pmem-csi-$node-pmem-csi-sc-xfs" \
    -o jsonpath='{.metadata.annotations.pmem-csi\.intel\.com/managed-bytes}')
  [[ -n $managed ]] || die "no managed-bytes annotation on pmem-csi-$node-pmem-csi-sc-xfs"
  free=$((managed - 320 * 1048576))
  wait_for 30 "$node publishing the claim's 320Mi as used" published_free_is "$node" pmem-csi-sc-xfs "$free"
  ask_for grow-xfs 640Mi
  wait_for 180 "claim grow-xfs grown to 640Mi by kubelet on $node" claim_capacity_is grow-xfs 640Mi
  kib=$(data_kib grower)
  # The file system gains (nearly) all of the 320Mi; xfs keeps its log out of df's total.
  ((kib - before >= 300 * 1024)) || die "the pod sees $kib KiB at /data after growing (was $before)"
  [[ $($KUBECTL get pod grower -o jsonpath='{.metadata.uid}/{.status.containerStatuses[0].restartCount}') == "$uid/0" ]] ||
    die "the pod was restarted or replaced by the growth"
  [[ $($KUBECTL exec grower -- cat /data/kept) == kept ]] || die "data written before the growth is gone"
  wait_for 30 "$node publishing 320Mi less" published_free_is "$node" pmem-csi-sc-xfs "$((free - 320 * 1048576))"
  log "expansion: grow-xfs 320Mi -> 640Mi under its running pod on $node (df: $before -> $kib KiB), data kept, capacity down by 320Mi"
  # More than the node has: refused with the driver's message, nothing changed.
  ask_for grow-xfs 64Gi
  wait_for 180 "the refused growth reported" reported grow-xfs grower "cannot grow from"
  claim_capacity_is grow-xfs 640Mi || die "the refused growth changed the claim's capacity"
  [[ $(data_kib grower) == "$kib" ]] || die "the refused growth changed the file system"
  published_free_is "$node" pmem-csi-sc-xfs "$((free - 320 * 1048576))" || die "the refused growth changed the published capacity"
  log "expansion: a growth beyond $node's room is refused with the driver's message and changes nothing"
  $KUBECTL delete pod grower --wait=true >/dev/null
  $KUBECTL delete pvc grow-xfs --wait=true >/dev/null
  # ext4 here: the driver says why before changing anything.
  apply_claim grow-ext4 64Mi pmem-csi-sc-ext4
  data_pod grower-ext4 grow-ext4 'true' | $KUBECTL apply -f - >/dev/null
  $KUBECTL wait --for=condition=Ready pod/grower-ext4 --timeout=120s >/dev/null || die "grower-ext4 not Ready"
  ask_for grow-ext4 128Mi
  wait_for 180 "the ext4 growth's refusal reported" reported grow-ext4 grower-ext4 CAP_SYS_RESOURCE
  claim_capacity_is grow-ext4 64Mi || die "the refused ext4 growth changed the claim's capacity"
  log "expansion: ext4 refused with CAP_SYS_RESOURCE named (this machine's limit)"
  $KUBECTL delete pod grower-ext4 --wait=true >/dev/null
  $KUBECTL delete pvc grow-ext4 --wait=true >/dev/null
  no_volume_left "the expansion checks"
  log "expansion passed in $((SECONDS - t0))s"
}

verify() {
  local t0=$SECONDS n out
  # Every container Ready, none restarted.
  out=$($KUBECTL -n pmem-csi get pods -o jsonpath='{range .items[*]}{range .status.containerStatuses[*]}{.name}={.ready}/{.restartCount} {end}{end}')
  [[ -n $out && $out != *=false* && ! $out =~ /[1-9] ]] || die "pmem-csi containers not all Ready with 0 restarts: $out"
  [[ $($KUBECTL -n pmem-csi get pods -l app.kubernetes.io/name=pmem-csi-node -o name | wc -l) == "${#NODES[@]}" ]] ||
    die "not one node pod per node"
  # CSINode: only kubelet writes it here (no testenv), through the registrar's registration.
  for n in "${NODES[@]}"; do
    wait_for 60 "CSINode $n lists pmem-csi.intel.com (kubelet's plugin watcher)" csinode_lists_driver "$n"
    wait_for 60 "capacity published by $n" capacity_of "$n"
    wait_for 60 "the heartbeat Lease of $n (through the node Lease policy)" heartbeat_of "$n"
  done
  # A late-binding claim: written by one pod, read back by the next.
  apply_claim data 256Mi pmem-csi-sc-ext4
  data_pod writer data 'echo written-by-writer > /data/hello && sync' | $KUBECTL apply -f - >/dev/null
  $KUBECTL wait --for=condition=Ready pod/writer --timeout=120s >/dev/null || die "writer not Ready"
  # The pod webhook (called by the apiserver through its Service) asked for the extender's resource.
  [[ $($KUBECTL get pod writer -o jsonpath='{.spec.containers[0].resources.requests}') == *pmem-csi.intel.com/scheduler* ]] ||
    die "the pod webhook did not mutate pod writer"
  # kube-scheduler asked the extender (on node-1, through the shipped scheduler configuration).
  out=$(curl -sf "http://$(node_ip "$EXTENDER_NODE"):10012/metrics") || die "no extender metrics"
  grep -qE '^pmem_csi_extender_requests_total\{route="filter",code="200"\} [1-9]' <<<"$out" ||
    die "kube-scheduler did not call the extender's /filter: $(grep '^pmem_csi_extender_requests_total' <<<"$out")"
  log "the pod webhook mutated the writer (through its Service) and kube-scheduler called the extender"
  local node pod
  node=$($KUBECTL get pod writer -o jsonpath='{.spec.nodeName}')
  $KUBECTL delete pod writer --wait=true >/dev/null
  data_pod reader data 'cat /data/hello' | $KUBECTL apply -f - >/dev/null
  $KUBECTL wait --for=condition=Ready pod/reader --timeout=120s >/dev/null || die "reader not Ready"
  [[ $($KUBECTL get pod reader -o jsonpath='{.spec.nodeName}') == "$node" ]] || die "reader not on $node"
  [[ $($KUBECTL logs reader) == written-by-writer ]] || die "reader read: $($KUBECTL logs reader)"
  log "a late-binding claim on $node: written by one pod, read back by the next"
  $KUBECTL delete pod reader --wait=true >/dev/null
  $KUBECTL delete pvc data --wait=true >/dev/null
  wait_for 60 "the claim's PV gone" no_pvs
  # kubelet itself made the node calls.
  pod=$($KUBECTL -n pmem-csi get pod -l app.kubernetes.io/name=pmem-csi-node --field-selector "spec.nodeName=$node" -o name)
  out=$($KUBECTL -n pmem-csi logs "$pod" -c pmem-driver)
  local call
  for call in CreateVolume NodeStageVolume NodePublishVolume NodeUnpublishVolume NodeUnstageVolume DeleteVolume; do
    grep -q "$call" <<<"$out" || die "no $call in the driver's log on $node"
  done
  # The examples: raw block, CSI inline ephemeral, generic ephemeral (with the imported busybox).
  local ex=$S/examples f pods
  mkdir -p "$ex"
  for f in pvc-block.yaml pod-inline-ephemeral.yaml pod-generic-ephemeral.yaml; do
    sed -E "s|^( *)image: .*busybox.*|\1image: $BUSYBOX_IMAGE\n\1imagePullPolicy: Never|" \
      "$REPO/manifests/examples/$f" >"$ex/$f"
  done
  $KUBECTL apply -f "$ex" >/dev/null
  pods=$($KUBECTL get pods -o name)
  # shellcheck disable=SC2086 # one argument per pod
  $KUBECTL wait --for=condition=Ready $pods --timeout=120s >/dev/null ||
    die "example pods not Ready: $($KUBECTL get pods)"
  log "examples Running: $(tr '\n' ' ' <<<"$pods")"
  $KUBECTL delete -f "$ex" --wait=true >/dev/null
  no_volume_left "the examples"
  expansion
  log "verify passed in $((SECONDS - t0))s"
}

# The e2e crate in cluster mode (tools/cluster-e2e.sh, shared with kind) against this cluster,
# its pods on the imported busybox; then no volume file is left on any node.
scenarios() {
  local t0=$SECONDS
  KUBECONFIG=$S/pki/admin.kubeconfig KUBECTL=$KUBECTL PMEM_CSI_E2E_IMAGE=$BUSYBOX_IMAGE \
    bash "$here/cluster-e2e.sh" scenarios "$TOP/logs/scenarios" ||
    die "e2e scenarios failed (kubelet and containerd logs: $TOP/logs/last-run after stop)"
  no_volume_left "the scenarios"
  log "e2e scenarios passed in $((SECONDS - t0))s; no volume left on any node"
}

# ---------------------------------------------------------------------------------------------
# The Helm chart: installed as users install it, two instances side by side, uninstalled
# ---------------------------------------------------------------------------------------------
HELM="$(bash "$here/helm.sh" --print-dir)/helm --kubeconfig=$S/pki/admin.kubeconfig"
CHART=$REPO/charts/pmem-csi
SECOND=second.pmem-csi.intel.com

# Objects of driver instance <driver> that are left: cluster-scoped ones with its instance label,
# and its namespace <namespace>.
instance_left() { # <driver> <namespace>
  $KUBECTL get clusterroles,clusterrolebindings,csidrivers,storageclasses,mutatingwebhookconfigurations,validatingadmissionpolicies,validatingadmissionpolicybindings \
    -l "app.kubernetes.io/instance=$1" -o name
  $KUBECTL get namespace "$2" -o name 2>/dev/null || true
}
instance_gone() { [[ -z $(instance_left "$1" "$2") ]]; }
csinode_has() { $KUBECTL get csinode "$1" -o jsonpath='{.spec.drivers[*].name}' | grep -qw "$2"; }
csinode_lacks() { ! csinode_has "$1" "$2"; }
second_publishes() { $KUBECTL -n pmem-csi-second get csistoragecapacity "pmem-csi-$1-second-pmem-csi-sc-ext4" >/dev/null 2>&1; }
first_free_all() { local n; for n in "${NODES[@]}"; do echo "$n=$(published_free "$n" pmem-csi-sc-ext4)"; done; }
# Helm's --set items giving every image as `images` imported it.
image_values() {
  local v=(--set image.repository=localhost/pmem-csi --set image.tag=dev) s i
  for s in provisioner:$PROVISIONER_IMAGE resizer:$RESIZER_IMAGE registrar:$REGISTRAR_IMAGE; do
    i=${s#*:}
    v+=(--set "sidecars.${s%%:*}.repository=${i%:*}" --set "sidecars.${s%%:*}.tag=${i##*:}")
  done
  printf '%s\n' "${v[@]}"
}
# A claim of class <class> used by a busybox pod, Running; then both deleted and the PV gone.
claim_works() { # <class> <what>
  apply_claim probe 64Mi "$1"
  data_pod probe probe 'echo ok > /data/ok' | $KUBECTL apply -f - >/dev/null
  $KUBECTL wait --for=condition=Ready pod/probe --timeout=120s >/dev/null || die "$2: pod on class $1 not Ready"
  local pv
  pv=$($KUBECTL get pvc probe -o jsonpath='{.spec.volumeName}')
  $KUBECTL delete pod probe --wait=true >/dev/null
  $KUBECTL delete pvc probe --wait=true >/dev/null
  wait_for 60 "$2: PV $pv gone" no_pvs
  echo "$pv"
}

chart() {
  local t0=$SECONDS n values first_free pv left
  mapfile -t values < <(image_values)
  # The kustomize install goes first, and nothing of it may stay.
  $KUBECTL delete -k "$S/deploy" --wait=true >/dev/null
  wait_for 180 "the kustomize install gone" instance_gone pmem-csi.intel.com pmem-csi
  $HELM install pmem-csi "$CHART" -n pmem-csi --create-namespace --set schedulerExtender.enabled=true \
    "${values[@]}" --wait --timeout 300s >/dev/null || die "helm install pmem-csi"
  log "helm install of the chart (= overlays/emulated + components/scheduler-extender) done $((SECONDS - t0))s after the kustomize install went"
  # The same checks as after `kubectl apply -k`: late binding, webhook and extender, raw block,
  # inline and generic ephemeral volumes, clean-up, expansion.
  verify
  # A second instance on the same nodes, in its own namespace, under its own driver name.
  $HELM install second "$CHART" -n pmem-csi-second --create-namespace \
    -f "$CHART/ci/second-instance-values.yaml" --set schedulerExtender.enabled=false \
    --set emulated.size=1Gi "${values[@]}" --wait --timeout 300s >/dev/null || die "helm install second"
  for n in "${NODES[@]}"; do
    wait_for 60 "CSINode $n lists $SECOND too" csinode_has "$n" "$SECOND"
    wait_for 60 "$n publishing for $SECOND" second_publishes "$n"
  done
  first_free=$(first_free_all)
  pv=$(claim_works second-pmem-csi-sc-ext4 "the second instance")
  [[ $(first_free_all) == "$first_free" ]] || die "the first instance's capacity moved with the second's volume: $first_free -> $(first_free_all)"
  [[ -z $($KUBECTL -n pmem-csi get csistoragecapacities -l "csi.storage.k8s.io/drivername=$SECOND" -o name) ]] ||
    die "the second instance published into the first's namespace"
  log "two instances: $SECOND provisioned $pv on its own class, publishing in its own namespace; the first's capacity unchanged"
  $HELM uninstall second -n pmem-csi-second --wait --timeout 300s >/dev/null || die "helm uninstall second"
  # What the running driver made (heartbeat Leases, capacity objects) goes with the namespace.
  $KUBECTL delete namespace pmem-csi-second --wait=true >/dev/null
  wait_for 120 "nothing of $SECOND left" instance_gone "$SECOND" pmem-csi-second
  for n in "${NODES[@]}"; do wait_for 60 "CSINode $n without $SECOND" csinode_lacks "$n" "$SECOND"; done
  claim_works pmem-csi-sc-ext4 "the first instance after the second's uninstall" >/dev/null
  log "the second instance uninstalled without a trace; the first still provisions"
  $HELM uninstall pmem-csi -n pmem-csi --wait --timeout 300s >/dev/null || die "helm uninstall pmem-csi"
  $KUBECTL delete namespace pmem-csi --wait=true >/dev/null
  wait_for 120 "nothing of pmem-csi.intel.com left" instance_gone pmem-csi.intel.com pmem-csi
  left=$($KUBECTL get pv,csistoragecapacities -A -o name)
  [[ -z $left ]] || die "left after helm uninstall: $left"
  no_volume_left "helm uninstall"
  log "chart passed in $((SECONDS - t0))s: installed, verified, a second instance beside it, both uninstalled without a trace"
}

# ---------------------------------------------------------------------------------------------
# Stop: leave nothing behind
# ---------------------------------------------------------------------------------------------
# pids of every process whose mount namespace is node N's (containerd, shims, kubelet, kube-proxy).
ns_pids() { # <mount ns pin file>
  local want pid
  want=$(stat -L -c %i "$1" 2>/dev/null) || return 0
  for pid in /proc/[0-9]*; do
    [[ $(stat -L -c %i "$pid/ns/mnt" 2>/dev/null) == "$want" ]] && echo "${pid#/proc/}"
  done
  return 0
}

# pids in a cgroup subtree (pods' processes: they have their own mount namespaces).
cg_pids() { find "$1" -name cgroup.procs -exec cat {} + 2>/dev/null || true; }

# the pid recorded in $S/pids/<name>, if that process is still ours (its command line names $S)
pidof_ours() { # <name>
  local f=$S/pids/$1 p
  [[ -f $f ]] || return 0
  p=$(cat "$f")
  { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -qF "$S" && echo "$p"
  return 0
}

kill_wait() { # <signal> <pids...>
  local sig=$1; shift
  (($#)) || return 0
  kill "-$sig" "$@" 2>/dev/null || true
  for _ in $(seq "${GRACE_TENTHS:-50}"); do
    local alive=0 p
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.1
  done
}

stop() {
  local n p h
  # 1. nodes: kubelet and kube-proxy first (each needs ~2 s after SIGTERM: all in parallel), then
  #    the pods' processes and everything in the nodes' mount namespaces (containerd, shims):
  #    SIGKILL, since the namespaces and cgroups go away anyway.
  local pids=()
  for n in "${NODES[@]}"; do
    # shellcheck disable=SC2207
    for p in kubelet kube-proxy; do pids+=($(pidof_ours "$n-$p")); done
  done
  kill_wait TERM "${pids[@]}"
  log "kubelets and kube-proxies stopped"
  pids=()
  for n in "${NODES[@]}"; do
    # pod processes (own mount namespaces) by cgroup, in the pids hierarchy; then the node's own
    # shellcheck disable=SC2207
    pids+=($(cg_pids "/sys/fs/cgroup/pids/realnode-$n") $(ns_pids "$(mntns_file "$n")"))
  done
  kill_wait KILL "${pids[@]}"
  log "pods, shims and containerds killed"
  # 2. control plane: etcd last (an apiserver without etcd drains slowly)
  pids=()
  # shellcheck disable=SC2207
  for p in kube-scheduler kube-controller-manager kube-apiserver; do pids+=($(pidof_ours "$p")); done
  # kube-apiserver drains for up to 60 s after SIGTERM while watches are open; etcd is thrown
  # away anyway, so give it 2 s
  GRACE_TENTHS=20 kill_wait TERM "${pids[@]}"
  kill_wait KILL "${pids[@]}"
  # shellcheck disable=SC2046
  kill_wait TERM $(pidof_ours etcd)
  # shellcheck disable=SC2046
  kill_wait KILL $(pidof_ours etcd)
  log "control plane stopped"
  # 3. namespaces: unpinning the mount namespace drops all its mounts (pod overlays, tokens, ...)
  for n in "${NODES[@]}"; do
    if [[ -e $(mntns_file "$n") ]]; then
      umount "$(mntns_file "$n")" 2>/dev/null || true
      rm -f "$(mntns_file "$n")"
    fi
    ip route del "$(pod_subnet "$n")" 2>/dev/null || true
    ip link del "rn-$n" 2>/dev/null || true
    ip netns del "$(netns_name "$n")" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  nft delete table inet "$FORWARD_TABLE" 2>/dev/null || true
  restore_sysctls
  if [[ -z $(changed_sysctls) ]]; then rm -f "$SYSCTL_SAVED"; fi
  if mountpoint -q "$RUNDIR"; then umount "$RUNDIR"; fi
  rm -rf "$RUNDIR"
  # 4. loop devices of pods (e.g. pmem-csi's emulated PMEM) whose backing files are ours: their
  #    mounts went with the mount namespaces, but an attached loop device outlives them. Matched
  #    by device and inode, since the backing path is the one seen inside the node.
  local dev
  for dev in $(our_loops); do
    if losetup -d "$dev"; then log "detached $dev"; fi
  done
  # 5. cgroups made by us, kubelet and runc: deepest first
  for n in "${NODES[@]}"; do
    for h in "${CG_HIERARCHIES[@]}"; do
      [[ -d /sys/fs/cgroup/$h/realnode-$n ]] || continue
      find "/sys/fs/cgroup/$h/realnode-$n" -depth -type d -exec rmdir {} \; 2>/dev/null || true
      [[ -d /sys/fs/cgroup/$h/realnode-$n ]] && log "could not remove /sys/fs/cgroup/$h/realnode-$n"
    done
  done
  # 6. files
  if [[ -f $S/created-dirs ]]; then
    while read -r p; do rmdir "$p" || log "could not remove $p"; done <"$S/created-dirs"
  fi
  if grep -q " $S" /proc/self/mountinfo; then
    log "mounts left under $S:"; grep " $S" /proc/self/mountinfo
  else
    # keep the logs of the last run for a post-mortem, outside the state dir
    rm -rf "$TOP/logs/last-run"; mkdir -p "$TOP/logs"
    cp -r "$S/logs" "$TOP/logs/last-run" 2>/dev/null || true
    rm -rf "$S"
  fi
  log "stopped"
  leftovers
}

# loop devices backed by a file under $S
our_loops() {
  local ours name ino majmin dev_of_S
  [[ -d $S ]] || return 0
  ours=$(find "$S" -xdev -type f -size +0 -printf '%i\n' 2>/dev/null | sort -u)
  dev_of_S=$(stat -c '%Hd:%Ld' "$S")
  losetup -l -n --raw -O NAME,BACK-INO,BACK-MAJ:MIN | while read -r name ino majmin; do
    majmin=${majmin//\\x20/}
    if [[ $majmin == "$dev_of_S" ]] && grep -qx "$ino" <<<"$ours"; then echo "$name"; fi
  done
  return 0
}

# Reports anything of ours that is still there; exit status 1 if so.
leftovers() {
  local found=0 p
  for p in /proc/[0-9]*; do
    # ours: it names $S, or it lives in a mount namespace with our per-node bind mounts
    if { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF "$S" ||
       grep -qF " $S/node-" "$p/mountinfo" 2>/dev/null; then
      [[ ${p#/proc/} == "$$" || ${p#/proc/} == "$BASHPID" ]] && continue
      log "leftover process ${p#/proc/}: $({ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | cut -c1-150)"; found=1
    fi
  done
  if grep -E "realnode|$S|/var/lib/kubelet|pmem-csi" /proc/self/mountinfo; then log "leftover mounts ^"; found=1; fi
  if ip -o link | grep -E "$BRIDGE|rn-node"; then log "leftover links ^"; found=1; fi
  if ip netns list | grep realnode; then log "leftover netns ^"; found=1; fi
  if nft list table inet "$FORWARD_TABLE" >/dev/null 2>&1; then log "leftover nft table inet $FORWARD_TABLE"; found=1; fi
  if ip route | grep -E '10\.214\.|10\.213\.'; then log "leftover routes ^"; found=1; fi
  if [[ -n $(our_loops) ]]; then log "leftover loop devices: $(our_loops)"; found=1; fi
  # after $S is gone, a loop device of ours shows its node-side backing path
  if losetup -l -n --raw -O NAME,BACK-FILE | grep -E " ($S|/var/lib/pmem-csi|/var/lib/kubelet)"; then
    log "possibly leftover loop devices ^"; found=1
  fi
  if ls -d /sys/fs/cgroup/*/realnode-* 2>/dev/null; then log "leftover cgroups ^"; found=1; fi
  if [[ -e $SYSCTL_SAVED ]]; then
    log "kernel settings not restored (before start <, now >; saved in $SYSCTL_SAVED):"
    changed_sysctls >&3
    found=1
  fi
  for p in "$RUNDIR" "$S" "${NODE_DIRS[@]}"; do
    [[ -e $p ]] && { log "leftover file $p"; found=1; }
  done
  ((found == 0)) && log "nothing left behind"
  return $found
}

case ${1:-} in
  start) start ;;
  images) images ;;
  smoke) smoke ;;
  deploy) deploy ;;
  verify) verify ;;
  scenarios) scenarios ;;
  chart) chart ;;
  status) status ;;
  stop) stop ;;
  leftovers) leftovers ;;
  *) sed -n '/^# usage:/,/^#   stop/s/^# \{0,1\}//p' "$0" >&2; exit 2 ;;
esac
