#!/usr/bin/env bash
# The coding agents people use, end to end against `flashdraft serve`: Claude Code, Codex CLI,
# aider and opencode, each installed from its registry, each given one small task in a scratch
# git repo in its non-interactive mode, each under a time limit, each against a fresh server
# that records every request (--dump-requests). Then a report per agent: connected, requests,
# statuses, prompt tokens, cache reuse, time per turn (scripts/agents_report.py).
#
#   scripts/agents_check.sh                    # all four: claude codex aider opencode
#   scripts/agents_check.sh codex aider        # some of them
#   make agents-check                          # the same, all four
#
# What is checked is the protocol (every request answered 2xx, the agent's loop runs its
# turns to its own end), not the quality of the edit: the default model is SmolLM2-135M.
#
# Environment (defaults in brackets):
#   PY            python that runs flashdraft [.venv/bin/python]
#   AGENTS_PREFIX where the agents are installed [~/.cache/flashdraft/agents]
#   OUT           results: OUT/<agent>/{requests/,server.log,agent.log,repo/}, OUT/report.md
#                 [build/agents-check]
#   PORT          the server's port [8199]
#   CTX NP NPRED  the server's -c, -np and -n [16384 2 1024]: -c is split across the -np
#                 slots, so each slot holds 8192 tokens, SmolLM2's training context (Codex
#                 CLI's first prompt is 5.4k tokens, opencode's 7.4k); -n bounds the answers of
#                 clients that send no limit (aider, Codex CLI) so a weak model's runaway
#                 answer cannot eat the time limit
#   SERVE_ARGS    more server flags [--spec-type ngram --spec-dm-controller cost -t 2], `make serve`'s
#   LIMIT         seconds each agent may run [900]
#   CLAUDE_MAX_TURNS  Claude Code's --max-turns [4]: the 135M model rarely stops calling tools
# Pinned versions (override to try others): CLAUDE_CODE_VERSION CODEX_VERSION OPENCODE_VERSION
# AIDER_VERSION. Only npm and PyPI are reached; every agent's telemetry, update check and
# login is switched off by its own environment variable or config (see docs/agents.md).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
AGENTS_PREFIX="${AGENTS_PREFIX:-$HOME/.cache/flashdraft/agents}"
OUT="${OUT:-$ROOT/build/agents-check}"
PORT="${PORT:-8199}"
CTX="${CTX:-16384}"
NP="${NP:-2}"
NPRED="${NPRED:-1024}"
SERVE_ARGS="${SERVE_ARGS:---spec-type ngram --spec-dm-controller cost -t 2}"
LIMIT="${LIMIT:-900}"
CLAUDE_MAX_TURNS="${CLAUDE_MAX_TURNS:-4}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
AIDER_VERSION="${AIDER_VERSION:-0.86.2}"
TASK="Fix the bug in calc.py: add(a, b) must return a + b. Edit the file."
AGENTS=("$@")
[ ${#AGENTS[@]} -gt 0 ] || AGENTS=(claude codex aider opencode)
NPM_BIN="$AGENTS_PREFIX/npm/node_modules/.bin"
BASE="http://127.0.0.1:$PORT"

[ -x "$PY" ] || { echo "agents_check: $PY not found (run make setup, or set PY)" >&2; exit 1; }
OUT="$(mkdir -p "$OUT" && cd "$OUT" && pwd)"

install() {
  mkdir -p "$AGENTS_PREFIX/npm"
  local want=("@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" "opencode-ai@$OPENCODE_VERSION")
  if ! [ -x "$NPM_BIN/claude" ] || ! [ -x "$NPM_BIN/codex" ] || ! [ -x "$NPM_BIN/opencode" ] \
     || ! grep -q "\"version\": \"$CLAUDE_CODE_VERSION\"" "$AGENTS_PREFIX/npm/node_modules/@anthropic-ai/claude-code/package.json" 2>/dev/null; then
    echo "== installing ${want[*]} into $AGENTS_PREFIX/npm"
    npm i --prefix "$AGENTS_PREFIX/npm" --no-audit --no-fund "${want[@]}"
  fi
  if ! [ -x "$AGENTS_PREFIX/aider-venv/bin/aider" ]; then
    echo "== installing aider-chat==$AIDER_VERSION into its own venv $AGENTS_PREFIX/aider-venv"
    python3 -m venv "$AGENTS_PREFIX/aider-venv"
    "$AGENTS_PREFIX/aider-venv/bin/pip" install -q "aider-chat==$AIDER_VERSION"
  fi
  echo "== versions: claude $("$NPM_BIN/claude" --version 2>/dev/null | head -1); codex $("$NPM_BIN/codex" --version 2>/dev/null | tail -1);" \
       "opencode $("$NPM_BIN/opencode" --version 2>/dev/null | tail -1); aider $("$AGENTS_PREFIX/aider-venv/bin/aider" --version 2>/dev/null | tail -1)"
}

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

start_server() {  # $1: the agent's results folder
  local dir="$1"
  # shellcheck disable=SC2086
  (cd "$ROOT" && exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TQDM_DISABLE=1 "$PY" -m flashdraft.cli serve \
     $SERVE_ARGS -c "$CTX" -np "$NP" -n "$NPRED" --port "$PORT" --dump-requests "$dir/requests") >"$dir/server.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do
    if curl -sf "$BASE/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited:"; tail -20 "$dir/server.log"; return 1; }
    sleep 1
  done
  echo "server not ready after 300 s"; return 1
}

scratch_repo() {  # $1: folder; a tiny repo with one bug
  rm -rf "$1" && mkdir -p "$1"
  printf 'def add(a, b):\n    """Return the sum of a and b."""\n    return a - b\n' >"$1/calc.py"
  printf 'from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n' >"$1/test_calc.py"
  git -C "$1" init -q
  git -C "$1" add -A
  git -C "$1" -c user.name=check -c user.email=check@localhost commit -qm "calc with a bug"
}

run_claude() {  # Anthropic Messages, streaming, tools
  local home="$1/home" && mkdir -p "$home"
  # --bare: no hooks, plugins, CLAUDE.md discovery or background prefetches; --tools: three
  # built-in tools. The default system prompt and 18 tools are 20k-28k tokens, over what an
  # 8192-token slot holds (docs/agents.md); this is Claude Code's own option to trim it.
  (cd "$1/repo" && HOME="$home" ANTHROPIC_BASE_URL="$BASE" ANTHROPIC_API_KEY=none \
     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 \
     CLAUDE_CODE_MAX_OUTPUT_TOKENS="$NPRED" \
     timeout "$LIMIT" "$NPM_BIN/claude" -p --bare --tools "Read,Edit,Bash" --permission-mode acceptEdits \
       --max-turns "$CLAUDE_MAX_TURNS" --output-format json "$TASK" </dev/null)
}

run_codex() {  # OpenAI Responses, streaming, namespace + function tools
  local home="$1/codex-home" && mkdir -p "$home"
  cat >"$home/config.toml" <<EOF
model = "smollm2"
model_provider = "flashdraft"
approval_policy = "never"
sandbox_mode = "danger-full-access"
web_search = "disabled"
model_context_window = 8192
check_for_update_on_startup = false

[features]
multi_agent = false
goals = false

[analytics]
enabled = false

[model_providers.flashdraft]
name = "flashdraft"
base_url = "$BASE/v1"
wire_api = "responses"
env_key = "FLASHDRAFT_API_KEY"
EOF
  (cd "$1/repo" && HOME="$1" CODEX_HOME="$home" FLASHDRAFT_API_KEY=none \
     timeout "$LIMIT" "$NPM_BIN/codex" exec --skip-git-repo-check "$TASK" </dev/null)
}

run_aider() {  # Chat Completions, not streamed
  local home="$1/home" && mkdir -p "$home"
  cat >"$1/aider-models.json" <<EOF
{"openai/smollm2": {"max_input_tokens": 8192, "max_output_tokens": $NPRED, "input_cost_per_token": 0,
  "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}
EOF
  (cd "$1/repo" && HOME="$home" OPENAI_API_BASE="$BASE/v1" OPENAI_API_KEY=none LITELLM_LOCAL_MODEL_COST_MAP=True \
     timeout "$LIMIT" "$AGENTS_PREFIX/aider-venv/bin/aider" --model openai/smollm2 \
       --model-metadata-file "$1/aider-models.json" --edit-format whole --no-stream --no-pretty \
       --yes-always --no-auto-commits --no-check-update --analytics-disable --no-show-model-warnings \
       --no-gitignore --map-tokens 0 --message "$TASK" calc.py </dev/null)
}

run_opencode() {  # Chat Completions through the ai-sdk, streaming, tools
  local home="$1/home" && mkdir -p "$home"
  cat >"$1/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "provider": {
    "flashdraft": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "flashdraft",
      "options": {"baseURL": "$BASE/v1", "apiKey": "none"},
      "models": {"smollm2": {"name": "SmolLM2-135M-Instruct", "limit": {"context": 8192, "output": $NPRED}}}
    }
  },
  "model": "flashdraft/smollm2",
  "small_model": "flashdraft/smollm2",
  "autoupdate": false,
  "share": "disabled"
}
EOF
  (cd "$1/repo" && HOME="$home" OPENCODE_CONFIG="$1/opencode.json" OPENCODE_DISABLE_AUTOUPDATE=1 \
     OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1 OPENCODE_DISABLE_DEFAULT_PLUGINS=1 \
     timeout "$LIMIT" "$NPM_BIN/opencode" run "$TASK" </dev/null)
}

install
for agent in "${AGENTS[@]}"; do
  case "$agent" in claude|codex|aider|opencode) ;; *) echo "unknown agent $agent (claude codex aider opencode)" >&2; exit 2;; esac
  dir="$OUT/$agent"
  rm -rf "$dir" && mkdir -p "$dir"
  scratch_repo "$dir/repo"
  echo "== $agent: server on $BASE (-c $CTX -np $NP -n $NPRED $SERVE_ARGS), limit $LIMIT s"
  start_server "$dir"
  t0=$(date +%s.%N)
  set +e
  "run_$agent" "$dir" >"$dir/agent.log" 2>&1
  rc=$?
  set -e
  t1=$(date +%s.%N)
  sleep 2  # the last request's file is written when its response ends
  stop_server
  git -C "$dir/repo" diff --stat >"$dir/repo.diff" 2>/dev/null || true
  git -C "$dir/repo" diff >>"$dir/repo.diff" 2>/dev/null || true
  wall=$(python3 -c "print(round($t1 - $t0, 1))")
  printf '{"agent": "%s", "rc": %d, "wall_s": %s, "limit_s": %d}\n' "$agent" "$rc" "$wall" "$LIMIT" >"$dir/run.json"
  echo "== $agent: exit $rc after $wall s; $(ls "$dir/requests" | wc -l) requests"
done
"$PY" "$ROOT/scripts/agents_report.py" "$OUT" "${AGENTS[@]}" | tee "$OUT/report.md"
