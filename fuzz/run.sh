#!/usr/bin/env bash
# `make fuzz`: the atheris harnesses for a bounded time each, in their own venv (fuzz/.venv).
# If atheris cannot be installed here, say so and fall back to a long hypothesis run of the
# core properties for the same total time.
set -u
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-30}"
PYTHON="${PYTHON:-python3}"
VENV=fuzz/.venv
HARNESSES=(fuzz_decide fuzz_server fuzz_upstream fuzz_streams)
# Seeds per harness: fuzz/seeds-<name> if there is one, else the client requests in fuzz/seeds;
# and the longest input (a few upstream responses fit in 4 KiB).
declare -A MAX_LEN=([fuzz_upstream]=4096 [fuzz_streams]=2048)

install_atheris() {
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || return 1
    # (from /: the repository root on sys.path would hide a missing install of relay)
    (cd / && "$OLDPWD/$VENV/bin/python" -c 'import atheris, relay.runtime') 2>/dev/null && return 0
    "$VENV/bin/pip" install --quiet --upgrade pip &&
        "$VENV/bin/pip" install --quiet atheris -e . &&
        "$VENV/bin/python" -c 'import atheris'
}

hypothesis_fallback() {
    local budget=$((SECONDS_EACH * ${#HARNESSES[@]}))
    echo "make fuzz: atheris could not be installed on this machine (it needs a wheel for this"
    echo "Python or clang with libFuzzer to build); falling back to ${budget}s of hypothesis runs"
    echo "of tests/core/test_hostile_properties.py with fresh seeds."
    [ -x .venv/bin/pytest ] || make .venv/.installed >/dev/null
    local end=$((SECONDS + budget)) runs=0
    while [ "$SECONDS" -lt "$end" ]; do
        .venv/bin/pytest -q -p no:cacheprovider tests/core/test_hostile_properties.py \
            --hypothesis-seed="$RANDOM$RANDOM" -x >/tmp/relay-fuzz-hypothesis.log 2>&1 || {
            cat /tmp/relay-fuzz-hypothesis.log
            echo "make fuzz: hypothesis found a failing case (above)"
            return 1
        }
        runs=$((runs + 1))
    done
    echo "make fuzz: ${runs} hypothesis runs, no failure"
}

if ! install_atheris >/tmp/relay-fuzz-install.log 2>&1; then
    tail -5 /tmp/relay-fuzz-install.log
    hypothesis_fallback
    exit $?
fi

status=0
for harness in "${HARNESSES[@]}"; do
    corpus="fuzz/corpus/${harness#fuzz_}"
    seeds="fuzz/seeds-${harness#fuzz_}"
    [ -d "$seeds" ] || seeds=fuzz/seeds
    extra=()
    [ -n "${MAX_LEN[$harness]:-}" ] && extra=(-max_len="${MAX_LEN[$harness]}")
    [ -f "fuzz/${harness#fuzz_}.dict" ] && extra+=(-dict="fuzz/${harness#fuzz_}.dict")
    mkdir -p "$corpus" fuzz/crashes
    echo "== $harness: ${SECONDS_EACH}s (corpus $corpus, seeds $seeds)"
    "$VENV/bin/python" "fuzz/$harness.py" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 \
        -timeout=10 -artifact_prefix=fuzz/crashes/ -print_final_stats=1 "${extra[@]}" \
        "$corpus" "$seeds" 2>&1 | grep -E '^(#[0-9]+.*(DONE|INITED)|==|INFO: (Seed|Loaded)|stat::(number_of_executed_units|peak_rss_mb)|.*(Error|Exception|Traceback|crash|Assertion).*)' || true
    if [ "${PIPESTATUS[0]}" -ne 0 ]; then
        echo "make fuzz: $harness found a crash (fuzz/crashes/)"
        status=1
    fi
done
exit $status
