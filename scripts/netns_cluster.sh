#!/usr/bin/env bash
# A simulated two-node cluster on this machine: network namespaces joined by a veth pair.
#
#   scripts/netns_cluster.sh up [RATE]   create sw-node0 (10.77.0.1) and sw-node1 (10.77.0.2); the link
#                                        between them is shaped with tc tbf to RATE (default 1gbit) in
#                                        both directions; inside a node (loopback, the node's own
#                                        address) traffic is unshaped
#   scripts/netns_cluster.sh down        remove them (safe to run when they do not exist)
#   scripts/netns_cluster.sh status      print the namespaces, addresses and qdiscs
#
# Run a process on a node with `ip netns exec sw-node0 CMD`. Needs root (CAP_NET_ADMIN) and the
# iproute2 tools. netem (added delay) is not available in every kernel: only the rate is shaped.
# Names and addresses can be changed with SW_NETNS_PREFIX and SW_NETNS_SUBNET (first three octets).
set -euo pipefail

PREFIX="${SW_NETNS_PREFIX:-sw-node}"
SUBNET="${SW_NETNS_SUBNET:-10.77.0}"
N0="${PREFIX}0"
N1="${PREFIX}1"
RATE="${2:-1gbit}"

down() {
    ip netns del "$N0" 2>/dev/null || true   # deleting a namespace deletes its end of the veth pair,
    ip netns del "$N1" 2>/dev/null || true   # and with it the other end
}

up() {
    down
    ip netns add "$N0"
    ip netns add "$N1"
    ip link add swv0 netns "$N0" type veth peer name swv1 netns "$N1"
    local i ns
    for i in 0 1; do
        ns="${PREFIX}${i}"
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "${SUBNET}.$((i + 1))/24" dev "swv${i}"
        ip -n "$ns" link set "swv${i}" up
        # tbf: token bucket filter (rate, burst, queue latency); egress of each end shapes both directions
        ip netns exec "$ns" tc qdisc add dev "swv${i}" root tbf rate "$RATE" burst 256kb latency 20ms
    done
    ip -n "$N0" route get "${SUBNET}.2" >/dev/null  # the nodes reach each other over the pair
    echo "up: $N0 ${SUBNET}.1 <-> $N1 ${SUBNET}.2 over swv0/swv1, shaped to $RATE"
}

status() {
    local ns
    for ns in "$N0" "$N1"; do
        echo "== $ns"
        ip -n "$ns" -4 -brief addr 2>/dev/null || echo "(absent)"
        ip netns exec "$ns" tc qdisc show 2>/dev/null | grep tbf || true
    done
}

case "${1:-}" in
    up) up ;;
    down) down; echo "down" ;;
    status) status ;;
    *) echo "usage: $0 up [RATE] | down | status" >&2; exit 2 ;;
esac
