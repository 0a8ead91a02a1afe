#!/bin/bash
# bench.dispatch_pass_cost threads at $RATE a second; perf stat attached to it for 6 s of its delivery window
# (its setup takes about $DELAY s). Run from the project's root; prints the bench's summary and perf's counts.
set -eu
out=$(mktemp -d)
.venv/bin/python -m bench.dispatch_pass_cost threads --rate "${RATE:-10000}" --seconds 12 > "$out/bench.txt" 2>&1 &
pid=$!
sleep "${DELAY:-12}"
perf stat -e task-clock,context-switches,raw_syscalls:sys_enter,syscalls:sys_enter_futex,syscalls:sys_enter_poll,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom -p "$pid" -o "$out/perf.txt" -- sleep 6
wait "$pid"
head -2 "$out/bench.txt"
cat "$out/perf.txt"
