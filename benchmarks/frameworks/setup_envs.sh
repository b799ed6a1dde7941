#!/usr/bin/env bash
# Creates the benchmark's separate virtual environments:
#   .venvs/msswift  ms-swift 4.x (+ its own transformers/peft/trl)
#   .venvs/trl      TRL + peft
#   .venvs/corpus   chatterbot-corpus, installed with --target (pure data: the text that
#                   make_assets.py trains the tokenizer on and builds the chat samples from)
# Each one is installed with requirements/constraints.txt (torch==2.13.0: the CPU build on the
# local index; a looser spec pulls a multi-GB CUDA build). When a pinned lock file
# requirements/<env>.txt exists it is installed as is, so reruns get the same versions;
# otherwise the top-level requirements/<env>.in is resolved and the result frozen into the lock.
#
#   bash benchmarks/frameworks/setup_envs.sh [msswift] [trl] [corpus]   (default: all three)
#
# A failed environment does not stop the others; the exit status is the number of failures.
# Logs: .venvs/<env>.log. A finished environment has .venvs/<env>/.ok and is skipped next time.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENVS="$HERE/.venvs"
REQ="$HERE/requirements"
PYTHON="${PYTHON:-python3}"
mkdir -p "$VENVS"

# pip's own resolver output goes to the log; only a one-line verdict per env is printed.
install_venv() {
    local name="$1" venv="$VENVS/$1" log="$VENVS/$1.log"
    if [[ -f "$venv/.ok" ]]; then echo "[setup] $name: ready ($venv)"; return 0; fi
    echo "[setup] $name: installing into $venv (log: $log) ..."
    rm -rf "$venv"
    local source="$REQ/$name.txt" lock_exists=1
    [[ -f "$source" ]] || { source="$REQ/$name.in"; lock_exists=0; }
    {
        "$PYTHON" -m venv "$venv" &&
        "$venv/bin/pip" install --quiet --upgrade pip &&
        "$venv/bin/pip" install -c "$REQ/constraints.txt" -r "$source"
    } >"$log" 2>&1 || { echo "[setup] $name: FAILED, see $log"; tail -5 "$log" | sed 's/^/    /'; return 1; }
    if [[ $lock_exists == 0 ]]; then
        # Record the resolved set; torch's local tag (+cpu) is dropped so the constraint
        # file, not the lock, decides which build of 2.13.0 is picked.
        { echo "# Frozen by setup_envs.sh from $name.in on $(date -u +%F)"
          "$venv/bin/pip" freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
        } >"$REQ/$name.txt"
    fi
    "$venv/bin/pip" freeze >"$venv/installed.txt"
    touch "$venv/.ok"
    echo "[setup] $name: done"
}

install_corpus() {
    local target="$VENVS/corpus" log="$VENVS/corpus.log"
    if [[ -f "$target/.ok" ]]; then echo "[setup] corpus: ready ($target)"; return 0; fi
    echo "[setup] corpus: installing into $target (log: $log) ..."
    rm -rf "$target"
    "$PYTHON" -m pip install --no-deps --target "$target" -r "$REQ/corpus.in" >"$log" 2>&1 \
        || { echo "[setup] corpus: FAILED, see $log"; tail -5 "$log" | sed 's/^/    /'; return 1; }
    touch "$target/.ok"
    echo "[setup] corpus: done"
}

failures=0
envs=("$@")
[[ ${#envs[@]} -gt 0 ]] || envs=(corpus msswift trl)
for env in "${envs[@]}"; do
    case "$env" in
        corpus) install_corpus || failures=$((failures + 1)) ;;
        msswift | trl) install_venv "$env" || failures=$((failures + 1)) ;;
        *) echo "[setup] unknown environment: $env"; failures=$((failures + 1)) ;;
    esac
done
exit "$failures"
