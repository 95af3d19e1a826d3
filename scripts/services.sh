#!/usr/bin/env bash
# The services the test suite needs, brought up where they are missing:
#
#   redis      a Redis on 127.0.0.1:6379 (the suite's, TOOLEFFECT_TEST_REDIS_URL)
#   rabbitmq   a RabbitMQ on 127.0.0.1:5672, guest/guest, with rabbitmqctl
#   iproute2   ip, and root, for network namespaces (tests/faults/test_partition.py)
#   chromium   chromium and chromedriver (the Flower page test, tests/test_flower.py)
#
# Usage: scripts/services.sh [--require] [SERVICE...]   (no SERVICE: all four)
#
# A missing package is installed with apt-get (as root, on Debian or Ubuntu);
# a Redis or RabbitMQ that does not answer is started. `make test` runs this
# first, and .ci/run runs it with --require, one service per section.
#
# Without --require a service that cannot be brought up (not root, no
# apt-get, an install that fails) is named, with why, and the script goes on
# and ends with status 0: the tests that need it are skipped, saying why
# (tests/conftest.py). With --require (CI) it ends with status 1 there.
set -euo pipefail

require=0
services=()
for argument in "$@"; do
  case "$argument" in
    --require) require=1 ;;
    redis | rabbitmq | iproute2 | chromium) services+=("$argument") ;;
    -h | --help)
      sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "services.sh: unknown argument '$argument' (--require, redis, rabbitmq, iproute2, chromium)" >&2
      exit 2
      ;;
  esac
done
if [ "${#services[@]}" -eq 0 ]; then
  services=(redis rabbitmq iproute2 chromium)
fi

# Why the service being brought up is missing (set by the step that gave up).
why=""
apt_updated=0
missing=()

is_root() {
  [ "$(id -u)" -eq 0 ]
}

# Install Debian packages, or say why not (in $why) and return 1.
apt_install() {
  if ! is_root; then
    why="not root, so apt-get cannot install $*"
    return 1
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    why="no apt-get to install $* with"
    return 1
  fi
  echo "Installing $* with apt-get."
  export DEBIAN_FRONTEND=noninteractive
  if [ "$apt_updated" -eq 0 ]; then
    if ! apt-get update; then
      why="apt-get update failed"
      return 1
    fi
    apt_updated=1
  fi
  if ! apt-get install -y "$@"; then
    why="apt-get install -y $* failed"
    return 1
  fi
}

# Whether something accepts a TCP connection on 127.0.0.1:$1.
port_answers() {
  timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

redis_answers() {
  if command -v redis-cli >/dev/null 2>&1; then
    [ "$(timeout 5 redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = "PONG" ]
  else
    # RESP by hand: a server that wants a password answers -NOAUTH, not +PONG.
    timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/6379 && printf "PING\r\n" >&3 \
      && IFS= read -r line <&3 && [[ "$line" == "+PONG"* ]]' 2>/dev/null
  fi
}

# poll TRIES PAUSE COMMAND...: run COMMAND until it succeeds, at most TRIES
# times PAUSE seconds apart; its last status.
poll() {
  local tries=$1 pause=$2
  shift 2
  for _ in $(seq 2 "$tries"); do
    "$@" && return 0
    sleep "$pause"
  done
  "$@"
}

bring_up_redis() {
  # CI (--require) brings up the machine's server whatever the variable says.
  if [ "$require" -eq 0 ] && [ -n "${TOOLEFFECT_TEST_REDIS_URL:-}" ]; then
    echo "TOOLEFFECT_TEST_REDIS_URL names the suite's Redis: none is needed on 127.0.0.1:6379."
    return 0
  fi
  if redis_answers; then
    echo "Redis answers."
    return 0
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis-server not found."
    apt_install redis-server || return 1
  fi
  if redis_answers; then
    echo "Redis answers (started by its package)."
    return 0
  fi
  # Any user may start it: 6379 is no privileged port.
  echo "Starting redis-server."
  if ! redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no; then
    why="redis-server --port 6379 did not start"
    return 1
  fi
  if ! poll 50 0.2 redis_answers; then
    why="Redis does not answer on 127.0.0.1:6379 (is the port another program's?)"
    return 1
  fi
  echo "Redis answers."
}

# As root, rabbitmq-diagnostics must answer its ping too (the port opens before
# the broker is ready); another user cannot read the Erlang cookie it needs.
rabbitmq_answers() {
  port_answers 5672 || return 1
  if is_root; then
    command -v rabbitmq-diagnostics >/dev/null 2>&1 \
      && timeout 30 rabbitmq-diagnostics -q ping >/dev/null 2>&1
  fi
}

bring_up_rabbitmq() {
  # CI (--require) brings up the machine's server whatever the variable says.
  if [ "$require" -eq 0 ] && [ -n "${TOOLEFFECT_TEST_RABBITMQ_URL:-}" ]; then
    echo "TOOLEFFECT_TEST_RABBITMQ_URL names the suite's RabbitMQ: none is needed on 127.0.0.1:5672."
    return 0
  fi
  if rabbitmq_answers && command -v rabbitmqctl >/dev/null 2>&1; then
    echo "RabbitMQ answers."
    return 0
  fi
  if ! command -v rabbitmq-server >/dev/null 2>&1 || ! command -v rabbitmqctl >/dev/null 2>&1; then
    echo "rabbitmq-server or rabbitmqctl not found."
    apt_install rabbitmq-server || return 1
  fi
  if ! rabbitmq_answers; then
    if ! is_root; then
      why="RabbitMQ does not answer on 127.0.0.1:5672, and only root can start it here"
      return 1
    fi
    echo "Starting rabbitmq-server."
    # Debian's init script (runs it as the rabbitmq user), else the server itself.
    service rabbitmq-server start || rabbitmq-server -detached || true
    poll 120 1 rabbitmq_answers || true
  fi
  if ! rabbitmq_answers; then
    why="RabbitMQ does not answer on 127.0.0.1:5672"
    return 1
  fi
  echo "RabbitMQ answers."
}

bring_up_iproute2() {
  if command -v ip >/dev/null 2>&1; then
    echo "ip is installed."
  else
    echo "ip not found."
    apt_install iproute2 || return 1
  fi
  if ! is_root; then
    why="not root: network namespaces (ip netns add) need root"
    return 1
  fi
}

bring_up_chromium() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    echo "chromium and chromedriver are installed."
    return 0
  fi
  echo "chromium or chromedriver not found."
  apt_install chromium chromium-driver || return 1
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    why="chromium or chromedriver is still not on PATH after the install"
    return 1
  fi
}

declare -A skipped=(
  [redis]="the tests outside tests/unit are skipped"
  [rabbitmq]="the RabbitMQ tests are skipped (they fail under TOOLEFFECT_TEST_REQUIRE_RABBITMQ)"
  [iproute2]="the partition test is skipped (it fails under CI)"
  [chromium]="the Flower browser test is skipped"
)

for service in "${services[@]}"; do
  why=""
  # Called in a condition, so set -e does not stop inside: each step checks
  # its own failures and says why in $why.
  if ! "bring_up_$service"; then
    if [ "$require" -eq 1 ]; then
      echo "services.sh: $service is missing: ${why:-it could not be brought up}." >&2
      exit 1
    fi
    echo "services.sh: $service is missing: ${why:-it could not be brought up}; ${skipped[$service]}." >&2
    missing+=("$service")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "services.sh: missing ${missing[*]}: the tests that need them are skipped, saying why." >&2
fi
