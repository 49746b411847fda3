#!/usr/bin/env bash
# Run llama.cpp's own server test suite (tools/server/tests) against flashdraft.
#
#   scripts/llama_server_tests.sh [LLAMA_CPP_GIT_DIR] [-- PYTEST_ARGS...]
#   LCPP_SRC_DIR=DIR scripts/llama_server_tests.sh [-- PYTEST_ARGS...]
#
# LLAMA_CPP_GIT_DIR: a (bare) git dir of llama.cpp or of a fork holding the commit below
# (also $LLAMA_CPP_GIT_DIR). Or, without git, LCPP_SRC_DIR: a folder already holding
# llama.cpp's files at their repository paths (a checkout, an unpacked source archive):
# tools/server/tests, and, for the tests that read them, models/templates and
# tools/mtmd/test-1.jpeg. They are copied; the folder is not changed. Each test starts "llama-server" through
# scripts/llama_server_shim.py, which serves flashdraft's packaged default model with the
# test's other flags unchanged (see that file).
#
# Environment (defaults in brackets):
#   LCPP_SRC_DIR       llama.cpp files to test instead of a git dir's commit (see above); the
#                      commit they come from is then up to you (name it in your results)
#   LLAMA_CPP_COMMIT   llama.cpp commit to test [27df9199d16c393868d20b3ed28b4f72e30de6bd,
#                      upstream master 2026-08-15, "fix: check gguf array type before reading (#27075)"]
#   LCPP_WORK          where the tests are extracted and results written [/tmp/lcpp-tests]
#   LCPP_VENV          venv with upstream's tests/requirements.txt + pytest-timeout [/tmp/lcpp-venv]
#   LCPP_FILES         test files, relative to tools/server/tests
#                      [the six below]
#   PORT               server port the tests use (upstream utils.py reads it) [18080]
#   LCPP_TEST_TIMEOUT  pytest-timeout per test, seconds [900]
#   LCPP_START_TIMEOUT seconds a server may take to answer /health 200 [300; upstream: 60]
#   FLASHDRAFT_PYTHON  the Python that runs flashdraft's server [this checkout's .venv/bin/python]
#   LCPP_FLASHDRAFT_REV  a flashdraft commit to test instead of the working tree: it is
#                      extracted (git archive) to $LCPP_WORK/flashdraft and the server runs
#                      from there with this checkout's .venv, so edits made to the working
#                      tree during the run do not mix into the results [unset: the working tree]
#
# Results: $LCPP_WORK/junit.xml, $LCPP_WORK/pytest.log, $LCPP_WORK/shim.log (each server
# command line as the tests gave it and as passed to flashdraft), $LCPP_WORK/flashdraft.txt
# (the flashdraft revision tested).
#
# Changes to upstream's harness, all made from a conftest.py added next to the tests
# (tools/server/tests/unit/conftest.py; no upstream file is edited):
#   - the session fixture load_server_presets (starts every preset once to download its
#     model) is replaced by a no-op: there is no model hub here, and each start costs ~40 s;
#     download_file (a test's extra model file) leaves an empty placeholder instead;
#   - ServerProcess.start's default timeout 60 s is raised to $LCPP_START_TIMEOUT: the
#     model loads in 20-40 s on a 2-core machine, more when the machine is busy;
#   - ServerProcess.make_request returns its headers in a case-insensitive dict (HTTP
#     header names are case-insensitive; uvicorn sends them lowercased, the harness looks
#     up llama-server's capitalisation in a plain dict).
set -euo pipefail

ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
GIT_DIR_ARG=""
if [[ $# -gt 0 && "$1" != "--" ]]; then GIT_DIR_ARG=$1; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi
LLAMA_CPP_GIT_DIR=${GIT_DIR_ARG:-${LLAMA_CPP_GIT_DIR:-}}
LLAMA_CPP_COMMIT=${LLAMA_CPP_COMMIT:-27df9199d16c393868d20b3ed28b4f72e30de6bd}
LCPP_WORK=${LCPP_WORK:-/tmp/lcpp-tests}
LCPP_VENV=${LCPP_VENV:-/tmp/lcpp-venv}
LCPP_FILES=${LCPP_FILES:-"unit/test_basic.py unit/test_tokenize.py unit/test_security.py unit/test_metrics.py unit/test_completion.py unit/test_chat_completion.py"}
export PORT=${PORT:-18080}
LCPP_TEST_TIMEOUT=${LCPP_TEST_TIMEOUT:-900}
export LCPP_START_TIMEOUT=${LCPP_START_TIMEOUT:-300}

LCPP_SRC_DIR=${LCPP_SRC_DIR:-}
if [[ -n "$LCPP_SRC_DIR" ]]; then
    if [[ ! -f "$LCPP_SRC_DIR/tools/server/tests/utils.py" ]]; then
        echo "LCPP_SRC_DIR=$LCPP_SRC_DIR holds no tools/server/tests/utils.py" >&2
        exit 2
    fi
elif [[ -z "$LLAMA_CPP_GIT_DIR" ]]; then
    echo "usage: $0 LLAMA_CPP_GIT_DIR [-- PYTEST_ARGS...]  (or set LLAMA_CPP_GIT_DIR or LCPP_SRC_DIR)" >&2
    exit 2
elif ! git --git-dir="$LLAMA_CPP_GIT_DIR" cat-file -e "$LLAMA_CPP_COMMIT^{commit}" 2>/dev/null; then
    echo "commit $LLAMA_CPP_COMMIT is not in $LLAMA_CPP_GIT_DIR" >&2
    exit 2
fi

# 1. the tests, plus the upstream files they read by relative path (chat templates, a test image)
rm -rf "$LCPP_WORK/src"
mkdir -p "$LCPP_WORK/src"
if [[ -n "$LCPP_SRC_DIR" ]]; then
    for part in tools/server/tests models/templates tools/mtmd/test-1.jpeg; do
        if [[ -e "$LCPP_SRC_DIR/$part" ]]; then
            mkdir -p "$LCPP_WORK/src/$(dirname "$part")"
            cp -R "$LCPP_SRC_DIR/$part" "$LCPP_WORK/src/$part"
        else
            echo "note: $LCPP_SRC_DIR/$part is missing; the tests that read it will fail" >&2
        fi
    done
else
    git --git-dir="$LLAMA_CPP_GIT_DIR" archive "$LLAMA_CPP_COMMIT" \
        tools/server/tests models/templates tools/mtmd/test-1.jpeg 2> "$LCPP_WORK/archive.err" | tar x -C "$LCPP_WORK/src"
fi
TESTS="$LCPP_WORK/src/tools/server/tests"

cat > "$TESTS/unit/conftest.py" <<'EOF'
# Added by flashdraft's scripts/llama_server_tests.sh (not part of llama.cpp).
import os

import pytest
from requests.structures import CaseInsensitiveDict

import utils

_timeout = int(os.environ.get("LCPP_START_TIMEOUT", "300"))
# ServerProcess.start(self, timeout_seconds=DEFAULT_HTTP_TIMEOUT): the default is bound at
# definition time, so set it on the function itself
utils.ServerProcess.start.__defaults__ = (_timeout,)


# HTTP header names are case-insensitive; the harness copies them into a plain dict and
# looks up llama-server's spelling ("Process-Start-Time-Unix"), while uvicorn sends them
# lowercased: look them up without case
_make_request = utils.ServerProcess.make_request


def _case_insensitive_headers(self, *args, **kwargs):
    res = _make_request(self, *args, **kwargs)
    res.headers = CaseInsensitiveDict(res.headers)
    return res


utils.ServerProcess.make_request = _case_insensitive_headers


# no downloads: a test's extra model file (test_speculative.py's draft model) is an empty
# placeholder, as the shim drops model-file flags (a draft model becomes the shipped drafter)
def _no_download(url, output_file_path=None):
    path = output_file_path or "./tmp/" + url.split("/")[-1]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    open(path, "a").close()
    return path


utils.download_file = _no_download


@pytest.fixture(scope="session", autouse=True)
def load_server_presets():
    """Overrides tests/conftest.py's: no model downloads (flashdraft serves its packaged model)."""
    yield
EOF

# 2. the test venv (upstream's requirements + pytest-timeout), reused when present
if [[ ! -x "$LCPP_VENV/bin/pytest" ]] || ! "$LCPP_VENV/bin/python" -c "import pytest_timeout, openai, wget, prometheus_client" 2>/dev/null; then
    python3 -m venv "$LCPP_VENV"
    "$LCPP_VENV/bin/pip" install -q -r "$TESTS/requirements.txt" pytest-timeout
fi

# 3. the flashdraft under test
SERVE_ROOT=$ROOT
if [[ -n "${LCPP_FLASHDRAFT_REV:-}" ]]; then
    SERVE_ROOT="$LCPP_WORK/flashdraft"
    rm -rf "$SERVE_ROOT"
    mkdir -p "$SERVE_ROOT"
    git -C "$ROOT" archive "$LCPP_FLASHDRAFT_REV" | tar x -C "$SERVE_ROOT"
fi

# 4. run
{
    if [[ -n "${LCPP_FLASHDRAFT_REV:-}" ]]; then
        echo "flashdraft: $(git -C "$ROOT" rev-parse "$LCPP_FLASHDRAFT_REV") (snapshot in $SERVE_ROOT)"
    else
        echo "flashdraft: working tree of $ROOT at $(git -C "$ROOT" rev-parse HEAD); changes at start:"
        git -C "$ROOT" status --short
    fi
    if [[ -n "$LCPP_SRC_DIR" ]]; then
        echo "llama.cpp: files of $LCPP_SRC_DIR"
    else
        echo "llama.cpp: $LLAMA_CPP_COMMIT"
    fi
    echo "started: $(date -u +%FT%TZ)"
} > "$LCPP_WORK/flashdraft.txt"

export LLAMA_SERVER_BIN_PATH="$ROOT/scripts/llama_server_shim.py"
export FLASHDRAFT_ROOT="$SERVE_ROOT"
export FLASHDRAFT_PYTHON="${FLASHDRAFT_PYTHON:-$ROOT/.venv/bin/python}"
export FLASHDRAFT_SHIM_LOG="$LCPP_WORK/shim.log"
: > "$FLASHDRAFT_SHIM_LOG"
chmod +x "$LLAMA_SERVER_BIN_PATH"

cd "$TESTS"
set +e
# shellcheck disable=SC2086
"$LCPP_VENV/bin/pytest" -v -rfEsxX --durations=30 --timeout="$LCPP_TEST_TIMEOUT" \
    --junitxml="$LCPP_WORK/junit.xml" $LCPP_FILES "$@" 2>&1 | tee "$LCPP_WORK/pytest.log"
rc=${PIPESTATUS[0]}
set -e
echo "finished: $(date -u +%FT%TZ) (pytest exit $rc)" >> "$LCPP_WORK/flashdraft.txt"
echo "results: $LCPP_WORK/junit.xml, $LCPP_WORK/pytest.log"
exit "$rc"
