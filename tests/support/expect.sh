# Sourced by the tests/cli_*.sh scripts; they set $tmp (a scratch directory) and failures=0 first.
# expect CODE NEEDLE command...: the exit code, and NEEDLE (a fixed string, "" for none) in stdout+stderr
expect() {
    local code=$1 needle=$2
    shift 2
    "$@" >"$tmp/out" 2>"$tmp/err"
    local got=$?
    if [ "$got" -ne "$code" ] || { [ -n "$needle" ] && ! grep -qF -- "$needle" "$tmp/out" "$tmp/err"; }; then
        echo "FAIL: $* -> exit $got (want $code), looking for: $needle"
        sed 's/^/  out: /' "$tmp/out" | head -20
        sed 's/^/  err: /' "$tmp/err" | head -20
        failures=$((failures + 1))
    else
        echo "ok: $*"
    fi
}
